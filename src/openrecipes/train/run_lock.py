"""One job per run directory, and no worker outliving its launcher.

The launcher (the ``openrecipes train`` the user started) holds ``RUN_DIR/.openrecipes-run.lock`` while the job runs:
a second job on the same directory is refused, naming the process that holds it. A lock left by a killed launcher
(its process is gone) is taken over. Training processes started by the launcher ask the kernel to end them when it
dies, so a killed launcher leaves no workers writing into the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from openrecipes.config.rundir import LOCK_FILE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def live_holder(run_dir: str | os.PathLike) -> dict | None:
    """The lock record of the live process on this host that holds ``run_dir``, or None when none does."""
    try:
        holder = json.loads((Path(run_dir) / LOCK_FILE).read_text())
        pid, host = int(holder["pid"]), str(holder["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return holder if host == socket.gethostname() and pid > 0 and _alive(pid) else None


@contextlib.contextmanager
def run_dir_lock(run_dir: str | os.PathLike, command: str, *, field: str = "run_dir") -> Iterator[None]:
    """Hold the run directory for this process; ValueError naming ``field`` and the holder when another live job
    has it."""
    path = Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                       "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                pid, host = int(holder["pid"]), str(holder["host"])
            except (OSError, ValueError, KeyError, TypeError):
                holder, pid, host = {}, -1, ""
            if host == socket.gethostname() and pid > 0 and _alive(pid):
                raise ValueError(f"{field}: {run_dir} is in use by process {pid} ({holder.get('command', '?')}, "
                                 f"since {holder.get('since', '?')}); wait for it to finish or stop it") from None
            if host and host != socket.gethostname():
                raise ValueError(f"{field}: {run_dir} is held by process {pid} on {host}; if that job is gone, "
                                 f"remove {path}") from None
            path.unlink(missing_ok=True)  # its launcher is gone: a stale lock
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(mine)
        break
    else:
        raise ValueError(f"{field}: could not take {path}")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if path.read_text() == mine:
                path.unlink()


def exit_with_launcher(parent_pid: int | None = None) -> None:
    """Ask the kernel to send this process SIGTERM when its parent (the launcher's agent, or the tuner that started
    a trial) dies (Linux). With ``parent_pid``: end now if that parent died before the request was made (this
    process was handed to another parent in between)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    if parent_pid is not None and os.getppid() != parent_pid:
        raise SystemExit(f"openrecipes train: process {parent_pid}, which started this run, is gone; not starting")
