"""`openrecipes launch slurm RECIPE` (or ``--resume RUN_DIR``): check the recipe as `openrecipes train` would,
write its sbatch script (``train.sbatch``) and, with ``--submit``, queue it and follow the job to its end
(``train.slurm``)."""

from __future__ import annotations

import shlex
import sys


def register(subparsers) -> None:
    from openrecipes.config.cli_numbers import positive

    slurm_parent = subparsers.add_parser("launch", help="write a job script for a cluster scheduler",
                                         description="Write a job script that runs `openrecipes train` on a cluster.")
    schedulers = slurm_parent.add_subparsers(dest="scheduler", metavar="SCHEDULER", required=True)
    slurm = schedulers.add_parser("slurm", help="an sbatch script: srun starts one torchrun per node",
                                  description="Write an sbatch script (srun + torchrun) and print how to submit "
                                  "it; with --submit, submit it and follow the job to its end (docs/slurm.md).")
    slurm.add_argument("recipe", nargs="?", help="recipe YAML file (checked here, before the job is queued)")
    slurm.add_argument("--resume", metavar="RUN_DIR", help="instead of a recipe: continue the run in RUN_DIR from "
                       "its last checkpoint (after a node failure, a time limit, a cancel)")
    slurm.add_argument("--nodes", type=positive(int), required=True, help="nodes of the job (one torchrun each)")
    slurm.add_argument("--gpus-per-node", type=positive(int), required=True, help="GPUs (workers) per node")
    slurm.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a recipe key, e.g. --set steps=5 (repeatable)")
    slurm.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    slurm.add_argument("--account", help="Slurm account (default: yours)")
    slurm.add_argument("--time", default="04:00:00", help="wall-clock limit (default 04:00:00)")
    slurm.add_argument("--out", default=None, help="script path (default: <recipe or run directory name>.sbatch)")
    slurm.add_argument("--cpus-per-task", type=positive(int), default=16, help="CPUs per node's task (default 16)")
    slurm.add_argument("--port", type=positive(int), default=29500, help="the rendezvous port on the job's first node "
                       "(default 29500)")
    slurm.add_argument("--cpu", action="store_true", help="request no GPUs: the workers (--gpus-per-node of them "
                       "per node) run on CPU over gloo, as on a CPU partition or a test cluster")
    submitting = slurm.add_mutually_exclusive_group()
    submitting.add_argument("--submit", action="store_true", help="also submit the script (sbatch), follow the job "
                            "until it ends and report its state; exit status 0 only for COMPLETED; Ctrl-C cancels "
                            "the job")
    submitting.add_argument("--dry-run", action="store_true", help="only write the script (the default)")
    slurm.add_argument("--poll-seconds", type=positive(float), default=5.0,
                       help="with --submit: seconds between looks at the job's state (default 5)")
    slurm.add_argument("--wait-minutes", type=positive(float), default=None,
                       help="with --submit: stop following after this long, leaving the job queued (default: until "
                            "it ends)")
    slurm.set_defaults(func=run_slurm)


def run_slurm(args) -> int:
    from openrecipes.train.slurm import SlurmError

    try:
        return _write_and_submit(args)
    except SlurmError as error:  # the scheduler's own message, one line
        print(f"openrecipes launch: error: {error}", file=sys.stderr)
        return 1


def _write_and_submit(args) -> int:
    from pathlib import Path

    from openrecipes.train.cli import check_job_recipe
    from openrecipes.train.sbatch import check_script_values, write_sbatch
    from openrecipes.train.slurm import check_controller, submit_and_follow

    check_script_values(recipe=args.recipe, resume=args.resume, out=args.out, overrides=args.overrides,
                        partition=args.partition, account=args.account, time=args.time)
    # the checks `openrecipes train` makes before its workers start: a bad recipe fails here, not on the cluster
    check_job_recipe(args.recipe, args.overrides, world_size=args.nodes * args.gpus_per_node, resume=args.resume)
    out = Path(args.out or f"{Path(args.recipe or Path(args.resume).resolve()).stem}.sbatch")
    if args.submit:
        check_controller()  # no controller: nothing is written
    script = write_sbatch(args.recipe, out, resume=args.resume, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          overrides=args.overrides, partition=args.partition, account=args.account, time=args.time,
                          cpus_per_task=args.cpus_per_task, port=args.port, cpu=args.cpu)
    if not args.submit:
        print(f"wrote {out}\nsubmit it with: sbatch {shlex.quote(str(out))}")
        return 0
    print(f"wrote {out}", flush=True)
    deadline_s = None if args.wait_minutes is None else args.wait_minutes * 60
    return submit_and_follow(script.path, script.identity, script.output_dir, poll_s=args.poll_seconds,
                             deadline_s=deadline_s, sbatch_args=script.output_args())
