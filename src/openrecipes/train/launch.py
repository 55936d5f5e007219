"""Launching several processes: torchrun on one or more nodes, and an sbatch script for Slurm (submitted and
followed by ``openrecipes.train.slurm``).

torchrun's agent watches its workers: when one exits with an error the others are stopped and the job ends with
that error, instead of waiting forever in a collective. The agent runs in this process (torchrun's own ``run``), so a
failure is the agent's structured record of each failed worker (rank, exit status, the message the worker wrote to
its error file) and is shown as one line per worker, not as the agent's traceback.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import sys
from pathlib import Path

from openrecipes.utils import atomic_write_text, check_output_file


def torchrun_command(train_args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None) -> list[str]:
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"--nproc and --nnodes must be >= 1, got {nproc} and {nnodes}")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        command.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("--rdzv-endpoint HOST:PORT is needed with --nnodes > 1")
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=openrecipes"]
    return command + ["-m", "openrecipes", "train", *train_args]


def run_torchrun(train_args: list[str], **kwargs) -> int:
    """Start the workers as ``torchrun`` would (the command is printed, to be run by hand); the exit status is the
    first failed worker's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    command = torchrun_command(train_args, **kwargs)
    print("launching: " + shlex.join(command), file=sys.stderr, flush=True)
    command.append("--launch-command=openrecipes " + shlex.join(sys.argv[1:]))
    agent_args = get_args_parser().parse_args(command[3:])  # what follows `python -m torch.distributed.run`
    try:
        with _quiet_agent():
            run(agent_args)
    except ChildFailedError as failed:
        return report_failures(failed.failures)
    return 0


NO_MESSAGE = "To enable traceback"  # the agent's text for a worker that wrote no error file


def _message(failure) -> str:
    """The first line of what the worker recorded (its exception), or a pointer to its output."""
    message = failure.message
    if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": {...}}
        message = message.get("message", "")
    message = str(message).strip()
    if not message or message.startswith(NO_MESSAGE):
        return "no message recorded; see its output above"
    return message.splitlines()[0]


def record_worker_error(error: BaseException) -> None:
    """In a worker started by the agent: write ``error`` to the error file the agent reads (TORCHELASTIC_ERROR_FILE,
    in the format of torch's ``ErrorHandler``), with the time in nanoseconds, so the launcher can tell which worker
    failed first (the agent's own timestamp has whole seconds) and show that worker's message."""
    import json
    import os
    import time
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": f"{type(error).__name__}: {error}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(error)), "timestamp": str(int(time.time())),
        "time_ns": str(time.time_ns())}}}
    with open(path, "w") as handle:
        json.dump(record, handle)


def _failed_at(failure) -> tuple[int, int]:
    """Order of failure: workers that recorded their error, by the time they did; then the others."""
    try:
        return 0, int(failure.error_file_data["message"]["extraInfo"]["time_ns"])
    except (KeyError, TypeError, ValueError):
        return 1, int(failure.timestamp)


def _status(failure) -> str:
    return f"exit status {failure.exitcode}" if failure.exitcode >= 0 else f"signal {failure.signal_name()}"


def report_failures(failures: dict) -> int:
    """The first failed worker (rank, exit status, its own message), then the ranks that ended after it (most
    often only because it did); returns the first failure's exit status (1 for a worker ended by a signal)."""
    ordered = sorted(failures.items(), key=lambda item: (*_failed_at(item[1]), item[0]))
    rank, first = ordered[0]
    print(f"openrecipes train: rank {rank} failed ({_status(first)}): {_message(first)}", file=sys.stderr)
    if len(ordered) > 1:
        print("openrecipes train: then " + ", ".join(f"rank {r} ({_status(f)})" for r, f in ordered[1:])
              + "; torchrun stopped the rest", file=sys.stderr)
    return first.exitcode if first.exitcode > 0 else 1


@contextlib.contextmanager
def _quiet_agent():
    """The agent's own log lines (closing signals, its failure table) would bury the workers' messages; the
    summary above replaces them."""
    logger = logging.getLogger("torch.distributed.elastic")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# the script's second line: a file without it is not replaced (it is not a script this verb wrote)
SBATCH_MARK = "# written by openrecipes launch slurm; rerunning it may replace this file"
SBATCH_TEMPLATE = """#!/bin/bash
{mark}
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --cpus-per-task={cpus_per_task}
#SBATCH --time={time}
#SBATCH --output={log_dir}/%x-%j.out
{extra}
# One `openrecipes train` per node, as on a single machine: the first node's checks the recipe, builds data.build's
# rows and holds the run directory before its torchrun starts; each node's torchrun starts {gpus_per_node} workers
# and stops them all if one fails. The node's rank is read inside each task (srun sets SLURM_NODEID per node).
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$head_node MASTER_PORT={port}
srun --kill-on-bad-exit=1 bash -c 'exec python -m openrecipes train "$@" --node-rank "$SLURM_NODEID"' train \\
  {recipe} --nproc {gpus_per_node} --nnodes {nodes}{rendezvous}{overrides}
"""


def write_sbatch(recipe: str, out: Path, *, nodes: int, gpus_per_node: int, overrides: list[str],
                 partition: str | None = None, account: str | None = None, time: str = "04:00:00",
                 cpus_per_task: int = 16, port: int = 29500, cpu: bool = False) -> Path:
    """Write the job script; ``cpu``: request no GPUs (the workers, ``gpus_per_node`` of them, run on CPU)."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} and {gpus_per_node}")
    if not Path(recipe).is_file():
        raise FileNotFoundError(f"recipe {recipe} does not exist")
    _check_script_out(Path(out), recipe)
    extra = "\n".join(f"#SBATCH --{key}={value}" for key, value in (("partition", partition), ("account", account))
                      if value)
    text = SBATCH_TEMPLATE.format(
        job_name=Path(recipe).stem, nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task,
        gpus="" if cpu else f"#SBATCH --gpus-per-node={gpus_per_node}\n",
        time=time, log_dir=out.parent.resolve(), extra=extra, port=port, recipe=shlex.quote(str(Path(recipe).resolve())),
        overrides="".join(f" \\\n  --set {shlex.quote(o)}" for o in overrides), mark=SBATCH_MARK,
        # one node: torchrun's standalone rendezvous on a free port; several: the first node's port
        rendezvous=f' --rdzv-endpoint "$head_node:{port}"' if nodes > 1 else "")
    atomic_write_text(out, text)
    out.chmod(0o755)
    return out


def _check_script_out(out: Path, recipe: str) -> None:
    """The script never replaces the recipe (or sits inside it), nor a file that an earlier run of this verb did
    not write."""
    check_output_file(out, [recipe], option="--out")
    if out.exists():
        with open(out, "rb") as handle:
            head = handle.read(4096).decode("utf-8", errors="replace").splitlines()[:2]
        if head[1:] != [SBATCH_MARK]:
            raise ValueError(f"--out: {out} exists and was not written by openrecipes launch slurm; choose another "
                             "--out or remove it yourself")


def register(subparsers) -> None:
    slurm_parent = subparsers.add_parser("launch", help="write a job script for a cluster scheduler",
                                         description="Write a job script that runs `openrecipes train` on a cluster.")
    schedulers = slurm_parent.add_subparsers(dest="scheduler", metavar="SCHEDULER", required=True)
    slurm = schedulers.add_parser("slurm", help="an sbatch script: srun starts one torchrun per node",
                                  description="Write an sbatch script (srun + torchrun) and print how to submit "
                                  "it; with --submit, submit it and follow the job to its end (docs/slurm.md).")
    slurm.add_argument("recipe", help="recipe YAML file (checked here, before the job is queued)")
    slurm.add_argument("--nodes", type=int, required=True, help="nodes of the job (one torchrun each)")
    slurm.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (workers) per node")
    slurm.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a recipe key, e.g. --set steps=5 (repeatable)")
    slurm.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    slurm.add_argument("--account", help="Slurm account (default: yours)")
    slurm.add_argument("--time", default="04:00:00", help="wall-clock limit (default 04:00:00)")
    slurm.add_argument("--out", default=None, help="script path (default: <recipe name>.sbatch)")
    slurm.add_argument("--cpus-per-task", type=int, default=16, help="CPUs per node's task (default 16)")
    slurm.add_argument("--port", type=int, default=29500, help="the rendezvous port on the job's first node "
                       "(default 29500)")
    slurm.add_argument("--cpu", action="store_true", help="request no GPUs: the workers (--gpus-per-node of them "
                       "per node) run on CPU over gloo, as on a CPU partition or a test cluster")
    submitting = slurm.add_mutually_exclusive_group()
    submitting.add_argument("--submit", action="store_true", help="also submit the script (sbatch), follow the job "
                            "until it ends and report its state; exit status 0 only for COMPLETED; Ctrl-C cancels "
                            "the job")
    submitting.add_argument("--dry-run", action="store_true", help="only write the script (the default)")
    slurm.add_argument("--poll-seconds", type=float, default=5.0, help="with --submit: seconds between looks at "
                       "the job's state (default 5)")
    slurm.add_argument("--wait-minutes", type=float, default=None, help="with --submit: stop following after this "
                       "long, leaving the job queued (default: until it ends)")
    slurm.set_defaults(func=run_slurm)


def _check_recipe_inputs(recipe, recipe_file: str) -> None:
    """Every file the job's run reads must exist here, where the script is written (a login node sees the cluster's
    files), so a placeholder such as /path/to/data fails now rather than on the job's first node."""
    from openrecipes.train.run_inputs import named_run_inputs

    for key, path in named_run_inputs(recipe).items():
        if not path.exists():
            raise ValueError(f"{recipe_file}: {key}: {path} does not exist (the job would read it); give the path "
                             f"as the cluster sees it, e.g. --set {key}=PATH")


def run_slurm(args) -> int:
    from pathlib import Path

    from openrecipes.config.recipe import load_recipe

    from openrecipes.config.layout import with_world_size

    recipe = load_recipe(args.recipe, args.overrides)  # fail here, not on the cluster, on a bad recipe
    world = args.nodes * args.gpus_per_node
    if with_world_size(recipe.layout, world).world_size != world:
        raise ValueError(f"layout: tp·pp·cp·dp = {recipe.layout.world_size} but --nodes x --gpus-per-node = {world}")
    _check_recipe_inputs(recipe, args.recipe)
    out = Path(args.out or f"{Path(args.recipe).stem}.sbatch")
    if args.poll_seconds <= 0 or (args.wait_minutes is not None and args.wait_minutes <= 0):
        raise ValueError("--poll-seconds and --wait-minutes must be > 0")
    write_sbatch(args.recipe, out, nodes=args.nodes, gpus_per_node=args.gpus_per_node, overrides=args.overrides,
                 partition=args.partition, account=args.account, time=args.time, cpus_per_task=args.cpus_per_task,
                 port=args.port, cpu=args.cpu)
    if not args.submit:
        print(f"wrote {out}\nsubmit it with: sbatch {out}")
        return 0
    from openrecipes.train.slurm import SlurmError, submit_and_follow

    print(f"wrote {out}", flush=True)
    deadline_s = None if args.wait_minutes is None else args.wait_minutes * 60
    try:
        return submit_and_follow(out, poll_s=args.poll_seconds, deadline_s=deadline_s)
    except SlurmError as error:  # the scheduler's own message, one line
        print(f"openrecipes launch: error: {error}", file=sys.stderr)
        return 1
