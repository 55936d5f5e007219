"""One-process trials forked from a warm process: the interpreter and its imports (torch, Dynamo, DTensor, the
engine) are paid once per tuning instead of once per trial.

``python -m openrecipes.tune.zygote TUNER_PID`` imports what ``openrecipes train`` imports and the compiler (Dynamo
and Inductor), touches no device (CUDA is initialized by each trial, after the fork, as a new process would), checks
that a forked child can still initialize CUDA (else it starts again without Inductor), and then forks one child per
request read from its stdin, a JSON line ``{"argv": [...], "log": PATH}``. A child starts a session of its own (so the
tuner stops it and anything it starts with one signal to its group), writes its output to PATH and runs ``openrecipes
ARGV``; the zygote answers ``{"pid": N}`` and later ``{"exited": N, "returncode": R}`` (R as subprocess reports it:
negative for a signal). The zygote ends when the tuner closes its stdin or dies.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import traceback
from pathlib import Path

READY = "ready"
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
WITHOUT_INDUCTOR = "--without-inductor"


def _run_child(argv: list[str], log: str) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        # new text streams: the zygote's own may hold a lock or buffered bytes from before the fork
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.argv = ["openrecipes", *argv]
        import runpy

        # exactly `python -m openrecipes ARGV`, the command of a trial started cold, minus the interpreter's start
        runpy.run_module("openrecipes", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever ends the trial is its log's last word
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def preload_dynamo() -> None:
    """What every trial imports while it builds its model: Dynamo (``with torch.device("meta")`` and the recompute
    wrappers import it; on one H200 host, seconds a trial)."""
    import torch._dynamo  # noqa: F401
    import torch.utils._device  # noqa: F401


def preload_inductor() -> None:
    """What a compiled trial imports besides (about 3 s of its start on one H200 host). Inductor's import asks torch
    whether CUDA is available; torch's CUDA-runtime answer marks every later fork as unable to initialise CUDA
    ("Cannot re-initialize CUDA in forked subprocess", bench/compile_preload.py on an H200), NVML's answer does not:
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` is torch's switch for processes that fork. Trials inherit it, as they inherit
    the rest of the zygote's environment."""
    os.environ.setdefault(NVML_CHECK, "1")
    import torch._inductor.compile_fx  # noqa: F401


def forks_can_use_cuda() -> bool:
    """Whether a child forked now could initialise CUDA (torch has not marked forks as bad), without initialising
    it here or in the child."""
    pid = os.fork()
    if pid == 0:
        import torch

        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def preload(tuner_pid: int, *, inductor: bool) -> None:
    """The zygote's imports; where Inductor's import left forks unable to use CUDA, the zygote replaces itself
    (``exec``, which clears torch's mark) with one that does not import Inductor."""
    preload_dynamo()
    if inductor:
        preload_inductor()
        if not forks_can_use_cuda():
            os.execv(sys.executable,
                     [sys.executable, "-m", "openrecipes.tune.zygote", str(tuner_pid), WITHOUT_INDUCTOR])


def serve(tuner_pid: int, *, inductor: bool = True) -> None:
    from openrecipes.train.run_lock import exit_with_launcher

    exit_with_launcher(parent_pid=tuner_pid)
    import openrecipes.train.cli  # noqa: F401
    import openrecipes.train.loop  # noqa: F401 (with it torch, DTensor and the engine)

    preload(tuner_pid, inductor=inductor)

    def say(message: dict) -> None:
        os.write(1, (json.dumps(message) + "\n").encode())

    say({READY: os.getpid(), "inductor": "torch._inductor.compile_fx" in sys.modules})
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:  # the tuner closed its end
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _run_child(request["argv"], request["log"])
                children.add(pid)
                say({"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                say({"exited": pid, "returncode": _returncode(status)})


class ForkedTrial:
    """A trial forked by the zygote, with the part of ``subprocess.Popen`` the local runner uses."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.read_reports(0.0)
            self.returncode = self.zygote.exited.pop(self.pid, None)
        if self.returncode is None and self.zygote.process.poll() is not None and not _alive(self.pid):
            self.returncode = 1  # the zygote ended before it could report this trial's end: a failed trial
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"trial {self.pid}", timeout)
            self.zygote.read_reports(0.05)
        return self.returncode


class Zygote:
    """The tuner's side: start the warm process once, then fork trials from it."""

    def __init__(self, python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen([python, "-m", "openrecipes.tune.zygote", str(os.getpid())],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        start_new_session=True)  # Ctrl-C reaches the tuner, not the zygote
        self.exited: dict[int, int] = {}
        self._answers: list[dict] = []
        self._pending = b""
        ready = self._answer(READY)
        self.pid, self.inductor = int(ready[READY]), bool(ready.get("inductor"))

    def _answer(self, key: str, limit_s: float = 120.0) -> dict:
        deadline = time.monotonic() + limit_s
        while not any(key in answer for answer in self._answers):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the trial zygote did not answer ({key}; exit status {self.process.poll()})")
            self.read_reports(0.05)
        answer = next(a for a in self._answers if key in a)
        self._answers.remove(answer)
        return answer

    def read_reports(self, wait_s: float) -> None:
        readable, _, _ = select.select([self.process.stdout], [], [], wait_s)
        if not readable:
            return
        chunk = os.read(self.process.stdout.fileno(), 65536)
        self._pending += chunk
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            message = json.loads(line)
            if "exited" in message:
                self.exited[int(message["exited"])] = int(message["returncode"])
            else:
                self._answers.append(message)
        if not chunk:
            time.sleep(wait_s)  # the zygote ended: nothing more will come

    def fork(self, argv: list[str], log: Path) -> ForkedTrial:
        self.process.stdin.write((json.dumps({"argv": argv, "log": str(log)}) + "\n").encode())
        self.process.stdin.flush()
        return ForkedTrial(self, int(self._answer("pid")["pid"]))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


if __name__ == "__main__":
    serve(int(sys.argv[1]), inductor=WITHOUT_INDUCTOR not in sys.argv[2:])
