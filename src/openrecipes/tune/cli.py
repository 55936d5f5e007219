"""``openrecipes tune START.yaml``: measured trials from a starting recipe to a faster, verified recipe card."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from openrecipes.config.hardware import add_gpus_option
    from openrecipes.config.cli_numbers import at_least, positive
    from openrecipes.tune.runner import STABLE_MIN_STEPS

    parser = subparsers.add_parser(
        "tune", help="tune a starting recipe into a faster, verified recipe card through measured trials",
        description="Measure START.yaml, then candidates that change only performance-only fields (layout, "
                    "microbatch, recompute, offload, kernels), ranked and pruned by the planner; verify the fastest "
                    "against the start and write the tuned recipe, its card and the site into --out. Rerunning the "
                    "same command reuses the finished trials (docs/tune.md).")
    parser.add_argument("start", help="the starting recipe (YAML); its numerics never change")
    add_gpus_option(parser, default="auto", help="auto (this machine's GPUs, else CPU processes), cpu, or "
                                                 "COUNTxTYPE such as 2xH200; the count is the start's world size")
    parser.add_argument("--trials", type=positive(int), default=12,
                        help="trials, the starting point included (default 12)")
    parser.add_argument("--minutes", type=positive(float), default=30.0,
                        help="wall time of the whole command, verification and card included (default 30)")
    parser.add_argument("--remeasure", type=at_least(int, 0), default=2, metavar="PAIRS",
                        help="interleaved (start, winner) pairs measured again before a gain is published (default 2)")
    parser.add_argument("--trial-steps", type=positive(int), default=20,
                        help="steps per trial (default 20, window 5-19)")
    parser.add_argument("--window", type=at_least(int, 0), nargs=2, metavar=("FIRST", "LAST"),
                        help="measurement window (default: steps 5 to the last, earlier for short trials)")
    parser.add_argument("--stable-cv", type=at_least(float, 0), default=0.02, metavar="CV",
                        help=f"end a trial once at least {STABLE_MIN_STEPS} steps of its window are recorded and "
                             "their step times' coefficient of variation is at most CV (default 0.02); 0: every "
                             "trial runs all its steps")
    parser.add_argument("--cold-trials", action="store_true",
                        help="start every trial as a new process (by default a one-process trial is forked from a "
                             "process that has already imported torch and the engine, docs/tune.md)")
    parser.add_argument("--trial-timeout", type=positive(float), default=900.0, metavar="SECONDS",
                        help="limit of one trial (default 900; after the start: at most 3x its time, at least 120)")
    parser.add_argument("--nproc", type=positive(int), help="processes per trial (default: the world size)")
    parser.add_argument("--gpu-memory-gib", type=positive(float), metavar="GIB",
                        help="one device's memory the planner fits candidates into (default: the hardware table's; "
                             "on CPU the host's share); a start that does not fit is tuned from the smallest "
                             "change that does (docs/tune.md)")
    parser.add_argument("--calibration", dest="calibrations", action="append", type=Path, default=[], metavar="PATH",
                        help="an earlier tuning's calibration.json, its --out, or a directory of such outputs; "
                             "repeatable: the start's prediction begins from the refit of the same model family and "
                             "GPU type (others are said and left out; docs/tune.md)")
    parser.add_argument("--screen", type=at_least(int, 0), nargs="?", const=4, default=0, metavar="N",
                        help="before any trial, measure the ranks of the start and of the planner's first N "
                             "candidates (default 4) one at a time on this machine under a fake process group, and "
                             "prune those whose measured peak does not fit; when the fleet is not on this machine, "
                             "screen only, no trial (docs/tune.md)")
    parser.add_argument("--try", dest="tries", action="append", default=[], metavar='"KEY=VALUE ..."',
                        help="a candidate measured right after the start (performance-only fields), repeatable")
    parser.add_argument("--out", default="tune-out", help="output directory (default tune-out); an earlier tune "
                                                          "output there is resumed")
    parser.add_argument("--author", default="openrecipes tune", help="the card's author")
    parser.add_argument("--slurm", type=positive(int), metavar="GPUS_PER_NODE",
                        help="run each trial as a Slurm job of nodes of GPUS_PER_NODE (sbatch with the trial's time "
                             "limit, followed to its end, scancel on Ctrl-C); its script and output (train.log) land "
                             "in the trial's directory (docs/slurm.md)")
    parser.add_argument("--slurm-partition", help="with --slurm: the partition (default: the cluster's)")
    parser.add_argument("--slurm-account", help="with --slurm: the account (default: yours)")
    parser.add_argument("--slurm-cpu", action="store_true", help="with --slurm: request no GPUs, the workers "
                        "(GPUS_PER_NODE of them per node) run on CPU")
    parser.add_argument("--slurm-cpus-per-task", type=positive(int), default=16,
                        help="with --slurm: CPUs per node (default 16)")
    parser.add_argument("--slurm-poll-seconds", type=positive(float), default=5.0,
                        help="with --slurm: seconds between looks at the trial jobs (default 5)")
    parser.add_argument("--max-parallel", type=positive(int), default=1, metavar="K",
                        help="with --slurm: up to K search trials queued or running at once (default 1); the start, "
                             "the remeasured pairs and the ablations run one at a time (docs/slurm.md)")
    parser.set_defaults(func=run)


def _stable_cv(value: float) -> float | None:
    if not 0 <= value < 1:
        raise ValueError(f"--stable-cv: a coefficient of variation from 0 (off) to below 1, got {value}")
    return value or None


def run(args: argparse.Namespace) -> int:
    from openrecipes.train.run_lock import run_dir_lock
    from openrecipes.tune.progress import Progress
    from openrecipes.tune.runner import LocalRunner
    from openrecipes.tune.slurm_runner import SlurmRunner
    from openrecipes.tune.search import Search, TuneOptions

    options = TuneOptions(start=Path(args.start), out=Path(args.out), gpus=args.gpus, trials=args.trials,
                          minutes=args.minutes, trial_steps=args.trial_steps,
                          window=tuple(args.window) if args.window else None, nproc=args.nproc,
                          trial_timeout_s=args.trial_timeout, tries=tuple(args.tries), author=args.author,
                          remeasure=args.remeasure, stable_cv=_stable_cv(args.stable_cv),
                          gpu_memory_gib=args.gpu_memory_gib, calibrations=tuple(args.calibrations),
                          screen=args.screen)
    if args.max_parallel != 1 and args.slurm is None:
        raise ValueError(f"--max-parallel {args.max_parallel}: trials run one at a time on this machine; "
                         "several at once need --slurm")
    runner = (SlurmRunner(gpus_per_node=args.slurm, partition=args.slurm_partition, account=args.slurm_account,
                          cpu=args.slurm_cpu, cpus_per_task=args.slurm_cpus_per_task,
                          poll_s=args.slurm_poll_seconds, max_parallel=args.max_parallel) if args.slurm is not None
              else LocalRunner(warm=not args.cold_trials))
    if isinstance(runner, SlurmRunner):
        runner.check_out(options.out)
    progress = Progress(trials=options.trials, minutes=options.minutes)
    search = Search(options, runner, progress)
    from openrecipes.train.slurm import SlurmError

    with run_dir_lock(options.out, f"openrecipes tune {args.start}", field="--out"):  # one tuner per output
        try:
            from openrecipes.tune.screen import fleet_out_of_reach, screen_only

            if options.screen and fleet_out_of_reach(search.target, runner):
                return screen_only(search)
            return _tune(search, options, progress)
        except SlurmError as error:  # sbatch refused a trial, or the controller stopped answering: one line
            print(f"openrecipes tune: error: {error}; finished trials are kept in {options.out / 'trials.jsonl'}",
                  file=sys.stderr)
            return 1


def _tune(search, options, progress) -> int:
    """Search, verify, remeasure, ablate and publish; the exit status."""
    from openrecipes.tune.family_calibration import start_prediction
    from openrecipes.tune.journal import record_result
    from openrecipes.tune.publish import publish
    from openrecipes.tune.remeasure import ablate, remeasure
    from openrecipes.tune.verification import choose_winner

    result = search.run()
    start = start_prediction(result.records)  # the first prediction against its measurement, in tune.json
    extra = {"start_prediction": start.model_dump(mode="json")} if start is not None else {}
    if result.screen:  # what was measured one rank at a time, apart from the trials' figures
        from openrecipes.tune.publish import screened

        extra["screen"] = screened(result)
    progress.say("verifying the fastest candidates against the starting point")
    winner, failed = choose_winner(result)
    for verdict in failed:
        progress.say(f"trial {verdict.record['index']} failed verification: {'; '.join(verdict.failures)}; "
                     "trying the next fastest")
    gain = ablations = None
    if winner is not None:
        pairs = search.remeasure_pairs(winner.record)
        held = "" if pairs == options.remeasure else f" of the {options.remeasure} asked: the budget holds {pairs}"
        start = "the start" if result.unfit is None else "the reference"  # the start did not fit
        progress.say(f"measuring {start} and trial {winner.record['index']} again, interleaved "
                     f"({pairs} pairs{held})")
        gain = remeasure(search, winner.record, pairs)
        if gain.faster:
            ablations = ablate(search, result.candidates[winner.record["key"]], statistics.median(gain.winner))
    if winner is None or not gain.faster:
        why = gain.describe() if gain else ("no candidate passed verification" if failed
                                            else "no measured candidate was faster than the start")
        minutes = progress.elapsed_s() / 60
        record_result(options.out, {"outcome": "start kept", "why": why, "trials": len(result.records),
                                    "minutes": round(minutes, 3), **extra})
        print(f"openrecipes tune: no faster recipe found: {why}; the start stays as it is "
              f"({len(result.records)} trials, {minutes:.1f} minutes; {options.out / 'trials.jsonl'})")
        return 0
    published = publish(result, winner, failed, minutes=progress.elapsed_s() / 60, gain=gain, ablations=ablations)
    figures = published.figures  # the card's figures, quoted as it quotes them
    record_result(options.out, {**published.result_block(gain, trials=len(result.records)), **extra})
    print(f"openrecipes tune: {figures.start_tps:,.1f} -> {figures.tuned_tps:,.1f} tokens/s/GPU, gain "
          f"{gain.describe()}, {published.status}, {figures.minutes:.1f} of {options.minutes:g} minutes")
    print(f"  tuned recipe  {published.recipe}\n  card          {published.card}\n"
          f"  site          {published.site / 'index.html'}\n  trials        {options.out / 'trials.jsonl'}")
    return 0
