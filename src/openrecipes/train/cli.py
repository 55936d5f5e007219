"""`openrecipes train RECIPE [--set k=v ...] [--stop-after N]` and `openrecipes train --resume RUN_DIR`."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train a recipe (or resume a run directory)",
        description="Train the recipe in RECIPE (YAML). Keys can be overridden with --set a.b=c (values are YAML). "
                    "Writes RUN_DIR/recipe.yaml, run.json, metrics.jsonl and checkpoints/.")
    parser.add_argument("recipe", nargs="?", help="recipe YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set layout.dp=2 --set steps=5")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its last checkpoint; with RECIPE, that recipe, which "
                             "may differ from the run's only in performance-only fields and steps")
    parser.add_argument("--stop-after", type=int, metavar="N",
                        help="stop after step N (0-based) with a checkpoint, as an interruption would")
    launch = parser.add_argument_group("several processes (torchrun)")
    launch.add_argument("--nproc", type=int, default=1, help="processes on this node (GPUs, or CPU workers)")
    launch.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    launch.add_argument("--node-rank", type=int, default=0, help="this node's rank (0..nnodes-1)")
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous of a multi-node job")
    # the command the user typed, handed to the workers by the launcher (for run.json); not for users
    parser.add_argument("--launch-command", help=argparse.SUPPRESS)
    parser.add_argument("--exit-with-parent", type=int, metavar="PID",
                        help="end this run (and its workers) when process PID, the one that started it, exits: how "
                             "openrecipes tune starts its trials, so a killed tuner leaves no trial running")
    parser.set_defaults(func=run)


def _world_size(args: argparse.Namespace) -> int:
    """The processes of the job: torchrun's WORLD_SIZE in a worker, else what the launcher will start."""
    import os

    return int(os.environ.get("WORLD_SIZE", args.nproc * args.nnodes))


def _load(args: argparse.Namespace):
    """The recipe of RECIPE or the run being resumed, its dp worked out from the world size when it sets none."""
    return _with_world(_load_recipe(args), _world_size(args))


def _check_layout(recipe, config, world_size: int, world_from: str = "--nproc x --nnodes") -> None:
    """Refuse a layout the job cannot run before any worker starts (one line, naming the field); ``config``: the
    recipe's model config."""
    from openrecipes.config.layout import LayoutError, unsupported_reason
    from openrecipes.config.rundir import rows_directory
    from openrecipes.train.engine import check_mtp, layout_problems_for

    problems = layout_problems_for(recipe, config, world_size=world_size,
                                   rows=rows_directory(recipe.data.rows, recipe.run_dir))
    if problems:
        raise ValueError(f"{LayoutError(problems[0])} ({world_from} = {world_size} processes)")
    check_mtp(recipe, config)
    from openrecipes.plan.shape import model_shape

    reason = unsupported_reason(recipe.layout, model_shape(config).layout_model())
    if reason:
        raise ValueError(reason)


def check_job_recipe(recipe_file: str | None, overrides: list[str], *, world_size: int, resume: str | None = None,
                     world_from: str = "--nodes x --gpus-per-node"):
    """The recipe of a job another machine will run (``launch slurm``: RECIPE, or the run ``resume`` continues),
    refused here as ``openrecipes train`` would refuse it before starting a process: its fields, model overrides and
    layout, over ``world_size`` processes."""
    from openrecipes.checkpoint.hf import recipe_model_config

    job = argparse.Namespace(recipe=recipe_file, overrides=overrides, resume=resume)
    recipe = _with_world(_load_recipe(job), world_size)
    config = recipe_model_config(recipe)
    _check_job_inputs(recipe, recipe_file or resume)
    _check_layout(recipe, config, world_size, world_from)
    return recipe


def _check_job_inputs(recipe, recipe_file: str) -> None:
    """Every file the job's run reads must exist here, where the job is written (a login node sees the cluster's
    files), so a placeholder such as /path/to/data fails now rather than on the job's first node."""
    from openrecipes.train.run_inputs import named_run_inputs

    for key, path in named_run_inputs(recipe).items():
        if not path.exists():
            raise ValueError(f"{recipe_file}: {key}: {path} does not exist (the job would read it); give the path "
                             f"as the cluster sees it, e.g. --set {key}=PATH")


def _with_world(recipe, world_size: int):
    from openrecipes.config.layout import with_world_size

    return recipe.model_copy(update={"layout": with_world_size(recipe.layout, world_size)})


def _check_host_memory(recipe, config, processes: int, available_bytes: int | None = None) -> None:
    """Refuse a run whose planned host memory (plan/host.py) exceeds this host's available memory (MemAvailable,
    or ``available_bytes``), naming both."""
    from openrecipes.plan.host import available_host_bytes, check_host_memory, predict_host_memory

    if recipe.data.build is not None:
        row_tokens = recipe.data.build.row_tokens
    else:
        from openrecipes.data.manifest import read_manifest

        row_tokens = int(read_manifest(recipe.data.rows)["row_tokens"])
    prediction = predict_host_memory(recipe, config, row_tokens=row_tokens, processes_per_node=processes)
    check_host_memory(prediction, available_host_bytes() if available_bytes is None else available_bytes)


def _load_recipe(args: argparse.Namespace):
    from pathlib import Path

    from openrecipes.config.recipe import load_recipe
    from openrecipes.config.rundir import RECIPE_FILE

    if args.resume:
        recipe_path = Path(args.resume) / RECIPE_FILE
        if not recipe_path.is_file():
            raise FileNotFoundError(f"{recipe_path} is missing: {args.resume} is not a run directory")
        if args.recipe:  # as TRL's resume_from_checkpoint beside its config: RECIPE must be the run's, but for speed
            return _recipe_resuming(args.recipe, args.overrides, Path(args.resume))
        recipe = load_recipe(recipe_path, args.overrides)
        if Path(recipe.run_dir).resolve() != Path(args.resume).resolve():
            recipe = recipe.model_copy(update={"run_dir": str(args.resume)})
        return recipe
    if args.recipe:
        return load_recipe(args.recipe, args.overrides)
    raise ValueError("give a RECIPE file or --resume RUN_DIR")


def _recipe_resuming(recipe_file: str, overrides: list[str], run_dir) -> Any:
    """RECIPE (with ``overrides``) continuing the run in ``run_dir``: refused in one line naming the fields that
    differ from the run's recorded recipe, unless they are performance-only or ``steps`` (what --set may change on
    resume, train/resume.py)."""
    from openrecipes.config.recipe import load_recipe
    from openrecipes.train.resume import resumed_changes

    recipe = load_recipe(recipe_file, overrides)
    recipe = recipe.model_copy(update={"run_dir": str(run_dir)})  # the run resumed is --resume's, wherever RECIPE says
    resumed_changes(run_dir, recipe)
    return recipe


def _typed_command(args: argparse.Namespace) -> str:
    """The command the user typed (the launcher hands it to its workers for run.json)."""
    if args.launch_command:
        return args.launch_command
    return ("openrecipes " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["train"]
            else f"openrecipes train {args.recipe or '--resume ' + str(args.resume)}")


def run(args: argparse.Namespace) -> int:
    import os

    from openrecipes.train.run_lock import exit_with_launcher, run_dir_lock

    from openrecipes.checkpoint.hf import recipe_model_config

    counts = (("--nproc", args.nproc, 1), ("--nnodes", args.nnodes, 1), ("--node-rank", args.node_rank, 0))
    for option, value, least in counts:
        if value < least:
            raise ValueError(f"{option}: must be at least {least}, got {value}")
    if args.node_rank >= args.nnodes:
        raise ValueError(f"--node-rank: must be below --nnodes ({args.nnodes}), got {args.node_rank}")
    recipe = _load(args)
    config = recipe_model_config(recipe)  # once: every check below and the training in this process take it
    if "WORLD_SIZE" in os.environ:  # a training process torchrun started: it ends with its launcher
        exit_with_launcher()
        return _launch_or_train(args, recipe, config)
    if args.exit_with_parent is not None:
        exit_with_launcher(parent_pid=args.exit_with_parent)
    if args.node_rank != 0:  # the first node's launcher checks, builds the rows and holds the run directory
        return _launch_or_train(args, recipe, config)
    _check_layout(recipe, config, _world_size(args))  # an impossible layout is refused before anything is written
    _check_host_memory(recipe, config, args.nproc)      # and so is a run this host's memory cannot hold
    from pathlib import Path

    from openrecipes.train.run_inputs import claim_recipe_run_dir, forget_unused_run_dir

    fresh = not Path(recipe.run_dir).exists()
    claim_recipe_run_dir(recipe, None if args.resume else args.recipe)  # a directory the run may write, marked
    try:
        with run_dir_lock(recipe.run_dir, _typed_command(args)):
            _rows_for_the_run(recipe, config)
            return _launch_or_train(args, recipe, config)
    except BaseException:
        if fresh:  # refused before anything ran: the directory made for it goes again
            forget_unused_run_dir(Path(recipe.run_dir))
        raise


def _rows_for_the_run(recipe, config) -> None:
    """The recipe's rows built (once) and checked, before any training process starts."""
    from openrecipes.config.rundir import rows_directory
    from openrecipes.data.batching import check_rows_files
    from openrecipes.train.images import check_rows_directory
    from openrecipes.train.rows_vocabulary import check_rows_vocabulary

    if recipe.data.build is not None:
        from openrecipes.data.build import build_recipe_rows

        # built once; a resume (or a rerun) finds them built from the same settings and unchanged inputs
        build_recipe_rows(recipe.data.build, rows_directory(None, recipe.run_dir))
    rows = rows_directory(recipe.data.rows, recipe.run_dir)
    check_rows_files(rows)  # changed or damaged rows: one line here, before any training process starts
    check_rows_directory(recipe, config, rows)  # image rows the run can take
    check_rows_vocabulary(recipe, config, rows)  # and ids the model has


def _launch_or_train(args: argparse.Namespace, recipe, config) -> int:
    import os
    from pathlib import Path

    if (args.nproc > 1 or args.nnodes > 1) and "WORLD_SIZE" not in os.environ:
        from openrecipes.train.launch import run_torchrun

        forwarded = ([args.recipe] if args.recipe else []) + [f"--set={o}" for o in args.overrides]
        forwarded += ["--resume", args.resume] if args.resume else []
        forwarded += ["--stop-after", str(args.stop_after)] if args.stop_after is not None else []
        return run_torchrun(forwarded, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                            rdzv_endpoint=args.rdzv_endpoint)

    from openrecipes.train.loop import TrainingStopped, train

    if args.stop_after is not None and args.stop_after < 0:
        raise ValueError(f"--stop-after must be >= 0, got {args.stop_after}")
    command = _typed_command(args)
    if os.environ.get("RANK", "0") == "0":  # say where files go before anything is written there
        print(f"openrecipes train: writing to {Path(recipe.run_dir).resolve()}", file=sys.stderr)
    try:
        run_dir = train(recipe, command=command, resume=bool(args.resume), stop_after=args.stop_after,
                        config=config)
    except BaseException as error:
        from openrecipes.train.launch import record_worker_error

        record_worker_error(error)  # a worker started by the launcher: its own message, for the summary
        if isinstance(error, TrainingStopped):
            print(f"openrecipes train: stopped: {error}", file=sys.stderr)
            return 1
        raise
    from openrecipes.parallel.mesh import close_distributed

    close_distributed()
    if os.environ.get("RANK", "0") == "0":
        print(f"run directory: {run_dir}")
    return 0
