"""``openrecipes measure-rank RECIPE --gpus 8xH200``: ranks of a multi-GPU layout, each measured alone on this machine
under a fake process group (train/rank_measure.py), beside what the planner predicts for the same rank."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

RANK_MODULE = "openrecipes.train.rank_measure"


def register(subparsers: Any) -> None:
    from openrecipes.config.hardware import add_gpus_option

    p = subparsers.add_parser(
        "measure-rank", help="measure ranks of a multi-GPU layout one at a time on this machine, beside the planner",
        description=__doc__ + " Each rank runs in its own process, so each peak is that rank's. Memory is the "
        "rank's; times are its compute without communication; routing is balanced (docs/plan.md, 'One rank "
        "measured alone').")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, as for `openrecipes train`")
    add_gpus_option(p, required=True, help="the fleet the layout runs on, e.g. 8xH200 (its count is the world "
                                           "size; its type the planner's GPU)")
    p.add_argument("--ranks", help="comma-separated ranks to measure (default: the first rank of each distinct "
                                   "pipeline stage)")
    p.add_argument("--steps", type=int, default=3, help="steps per rank; the first is a warm-up left out of the times")
    p.add_argument("--out", type=Path, help="directory for the rows and each rank's JSON (default: the recipe's "
                                            "run_dir with -ranks appended)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def default_ranks(layout: Any, num_layers: int) -> list[int]:
    """The first rank of the first and the last pipeline stage and of each middle stage whose layer count differs
    from the middle stages before it. Every expert-parallel rank holds E/ep experts (the layout rules), so no rank
    of a stage holds more experts than its first."""
    from openrecipes.config.layout import stage_layer_counts

    counts = stage_layer_counts(layout, num_layers)
    per_stage = layout.world_size // layout.pp
    stages, seen = [], set()
    for stage, layers in enumerate(counts):
        if stage in (0, len(counts) - 1) or layers not in seen:
            stages.append(stage)
        if 0 < stage < len(counts) - 1:
            seen.add(layers)
    return [stage * per_stage for stage in stages]


def predicted(recipe: Any, config: Any, gpu_type: str, row_tokens: int) -> Any:
    """The planner's ``Plan`` of the recipe's run, as the tuner predicts a candidate (tune/predict.py): `openrecipes
    train`'s settings (plan/host.py ``recipe_setup``), the layout's rows per microbatch the recipe's."""
    from openrecipes.plan.hardware import load_hardware
    from openrecipes.plan.host import plan_recipe
    from openrecipes.plan.shape import model_shape

    return plan_recipe(recipe, model_shape(config, name=recipe.model), load_hardware(gpu_type), row_tokens)


def beside_plan(measured: dict[str, Any], plan: Any) -> dict[str, Any]:
    """One rank's record with the planner's figures for its stage: memory, the step's compute (every microbatch's
    forward and backward, recompute included) and the optimizer step."""
    stage, throughput = measured["pp_rank"], plan.throughput
    memory = plan.stages[stage]
    phases = measured["phases_s"]
    compute = sum(phases.get(k, 0.0) for k in ("forward", "backward", "forward_backward"))
    return {**measured, "measured_compute_s": compute,
            "predicted": {"allocated_gib": memory.allocated_gib, "reserved_gib": memory.reserved_gib,
                          "compute_s": throughput.stage_compute_s[stage] * measured["microbatches"],
                          "optimizer_s": throughput.stage_optimizer_s[stage],
                          "memory_parts_gib": memory.parts_gib}}


def failure_line(stderr: str) -> str:
    """The line of a failed rank process that says why: its last exception line with a message (torchrun-style
    ``[rank0]:`` prefixes removed), else its last exception line, else its last non-empty line. A wrapper raised
    ``from`` the cause with its message on later lines (the pipeline schedule's "RuntimeError:" over a CUDA
    out-of-memory error) would otherwise hide the cause."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    told = [line for line in errors if line.partition(":")[2].strip()]
    return (told or errors or lines or ["(no message)"])[-1]


def measure_in_process(recipe: str | Path, rank: int, world: int, out: Path, *, steps: int,
                       overrides: list[str] = (), timeout_s: float | None = None) -> dict[str, Any]:
    """One rank measured in a process of its own (so the peak is that rank's alone); its record, or a ValueError of
    one line saying why the process failed."""
    command = [sys.executable, "-m", RANK_MODULE, str(recipe), "--rank", str(rank), "--world", str(world),
               "--steps", str(steps), "--out", str(out)]
    for item in overrides:
        command += ["--set", item]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ}, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ValueError(f"rank {rank}: not measured within {timeout_s:g} s") from None
    if done.returncode != 0:
        raise ValueError(f"rank {rank}: the measuring process failed: {failure_line(done.stderr)}")
    return json.loads(out.read_text())


RANKS_MARKER = ".openrecipes-ranks"  # in an output directory measure-rank made: it writes there again, nowhere else


def _claim_out(out: Path, inputs: list[Any]) -> None:
    """The output directory: absent, empty, or one measure-rank made (a directory of other files, a file, a link,
    the working directory or an input is refused by --out before anything is written)."""
    from openrecipes.utils import atomic_write_text, check_output_dir

    check_output_dir(out, marker=RANKS_MARKER, writer="openrecipes measure-rank", overwrite=True,
                     inputs=inputs, option="--out", reused=True)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / RANKS_MARKER).is_file():
        atomic_write_text(out / RANKS_MARKER, "written by openrecipes measure-rank: its output directory, written "
                                              "into again only by measure-rank\n")


def _prepare(args: argparse.Namespace):
    """The recipe over the fleet's world size, checked as `openrecipes train` checks it, with its rows built."""
    from openrecipes.checkpoint.hf import recipe_model_config
    from openrecipes.config.hardware import parse_gpus
    from openrecipes.config.layout import with_world_size
    from openrecipes.config.recipe import load_recipe
    from openrecipes.config.rundir import rows_directory
    from openrecipes.train.cli import _check_layout
    from openrecipes.train.rank_measure import measured_recipe

    world, gpu_type = parse_gpus(args.gpus)
    recipe = load_recipe(args.recipe, args.overrides)
    out = args.out or Path(f"{recipe.run_dir}-ranks")
    recipe = recipe.model_copy(update={"layout": with_world_size(recipe.layout, world), "run_dir": str(out)})
    recipe = measured_recipe(recipe)
    config = recipe_model_config(recipe)
    _check_layout(recipe, config, world, world_from="--gpus")
    _claim_out(out, [args.recipe, recipe.data.rows])
    if recipe.data.build is not None:
        from openrecipes.data.build import build_recipe_rows

        build_recipe_rows(recipe.data.build, rows_directory(None, out))
    return recipe, config, world, gpu_type, out


def run(args: argparse.Namespace) -> int:
    from openrecipes.data.manifest import read_manifest
    from openrecipes.config.rundir import rows_directory

    if args.steps < 2:  # one step would time the warm-up it is meant to leave out
        raise ValueError(f"--steps: must be at least 2 (the first is a warm-up left out of the times), got "
                         f"{args.steps}")
    recipe, config, world, gpu_type, out = _prepare(args)
    ranks = _ranks(args.ranks, recipe.layout, config.num_hidden_layers, world)
    row_tokens = int(read_manifest(rows_directory(recipe.data.rows, out))["row_tokens"])
    plan = predicted(recipe, config, gpu_type, row_tokens)
    results, failed = [], []
    for number, rank in enumerate(ranks, 1):
        print(f"measure-rank: rank {rank} of {world} ({recipe.layout.label()}), {number} of {len(ranks)}: "
              f"{args.steps} steps in one process", file=sys.stderr, flush=True)
        try:
            measured = measure_in_process(args.recipe, rank, world, out / f"rank-{rank}.json", steps=args.steps,
                                          overrides=[*args.overrides, f"run_dir={out}"])
        except ValueError as error:  # the other ranks are still measured and reported; the exit says one failed
            failed.append({"rank": rank, "error": str(error)})
            print(f"measure-rank: {error}", file=sys.stderr, flush=True)
            continue
        results.append(beside_plan(measured, plan))
        print(f"measure-rank: rank {rank} done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"recipe": recipe.name, "layout": recipe.layout.label(), "gpus": args.gpus,
                          "ranks": results, "failed": failed}, indent=2))
    else:
        print(format_table(results, recipe.layout.label(), args.gpus))
        for failure in failed:
            print(f"rank {failure['rank']}: not measured: {failure['error']}")
    if failed:
        raise ValueError(f"{len(failed)} of {len(ranks)} ranks not measured: {failed[0]['error']}")
    return 0


def _ranks(text: str | None, layout: Any, num_layers: int, world: int) -> list[int]:
    if text is None:
        return default_ranks(layout, num_layers)
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ranks: expected comma-separated ranks such as 0,7, got {text[:80]!r}") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise ValueError(f"--ranks: {bad or text!r}: ranks run from 0 to {world - 1} on this fleet")
    return ranks


def rank_peak_gib(result: dict[str, Any]) -> float:
    """A measured rank's peak: the CUDA allocator's reserved peak on a GPU, else the process's resident peak on CPU
    (interpreter included), the only peak the CPU allocator leaves to read."""
    return result["peak_reserved_gib"] if "peak_reserved_gib" in result else result["peak_rss_gib"]


def format_table(results: list[dict[str, Any]], label: str, gpus: str) -> str:
    """Measured beside predicted per rank. A CPU run has no allocator peak: its resident peak (interpreter
    included) stands in, and tiny widths say nothing of a GPU's times."""
    lines = [f"{label} on {gpus}: each rank alone under a fake process group (no communication; balanced routing)",
             f"{'rank':>5} {'stage':>5} {'params':>11} {'peak GiB':>9} {'pred alloc':>10} {'pred resv':>9} "
             f"{'fwd s':>8} {'bwd s':>8} {'fwd+bwd s':>9} {'pred s':>8} {'optim s':>8} {'pred s':>8}"]
    for r in results:
        p = r["predicted"]
        peak = rank_peak_gib(r)
        phases = r["phases_s"]
        params = r["parameters"]["dense"] + r["parameters"]["experts"]
        lines.append(f"{r['rank']:>5} {r['pp_rank']:>5} {params:>11,} {peak:>9.2f} {p['allocated_gib']:>10.2f} "
                     f"{p['reserved_gib']:>9.2f} {phases.get('forward', float('nan')):>8.3f} "
                     f"{phases.get('backward', float('nan')):>8.3f} {r['measured_compute_s']:>9.3f} "
                     f"{p['compute_s']:>8.3f} {phases['optimizer']:>8.3f} {p['optimizer_s']:>8.3f}")
    cpu = any("peak_rss_gib" in r for r in results)
    lines.append("peak GiB: " + ("the process's resident peak on CPU (interpreter included), not a GPU allocator's"
                                 if cpu else "the CUDA allocator's reserved peak; allocated peak in --json"))
    return "\n".join(lines)
