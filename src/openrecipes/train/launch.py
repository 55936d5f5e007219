"""Launching several processes: torchrun on one or more nodes (on Slurm, from the script of
``openrecipes.train.sbatch``, which ``openrecipes launch slurm`` writes).

torchrun's agent watches its workers: when one exits with an error the others are stopped and the job ends with
that error, instead of waiting forever in a collective. The agent runs in this process (torchrun's own ``run``), so a
failure is the agent's structured record of each failed worker (rank, exit status, the message the worker wrote to
its error file) and is shown as one line per worker, not as the agent's traceback.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import sys



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


def _failed_at(failure) -> tuple[int, int, int]:
    """Order of failure: workers that ended on their own before those the agent stopped (SIGTERM, SIGKILL: a worker
    it stops may still record that signal as its error, after the real failure); within each, those that recorded
    their error, by the time they did, then the others."""
    stopped = int(failure.exitcode in (-signal.SIGTERM, -signal.SIGKILL))
    try:
        return stopped, 0, int(failure.error_file_data["message"]["extraInfo"]["time_ns"])
    except (KeyError, TypeError, ValueError):
        return stopped, 1, int(failure.timestamp)


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
