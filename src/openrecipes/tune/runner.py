"""Trials as real runs: ``openrecipes train`` in its own process (torchrun for several), a time limit, then the
measurement of ``openrecipes measure``.

``LocalRunner`` runs on this machine; ``tune.slurm_runner.SlurmRunner`` submits each trial as a Slurm job, for
clusters larger than one machine.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

TRAIN_LOG = "train.log"


@dataclass(frozen=True, kw_only=True)
class TrialRun:
    recipe_path: Path  # the trial's recipe YAML (its run_dir is ``run_dir``)
    run_dir: Path
    nproc: int
    timeout_s: float
    window: tuple[int, int]
    # an early end (stable_window): once the window's step times vary less than ``stable_cv`` and their mean is
    # above ``end_if_slower_than_s`` (0: whatever it is); None: the trial runs all its steps
    stable_cv: float | None = None
    end_if_slower_than_s: float | None = None
    # the trial's steps: once the last is recorded its figures and loss curve are complete, and the runner ends it
    # there instead of waiting for what follows (a LoRA adapter's save, the process's teardown); None: it exits
    steps: int | None = None


STABLE_MIN_STEPS = 4  # window steps an early end needs at least


def _step_times(run_dir: Path) -> dict[int, Any]:
    """Each recorded step's time so far (empty before the metrics are written)."""
    from openrecipes.config.rundir import METRICS_FILE, read_metrics

    try:
        records = read_metrics(run_dir / METRICS_FILE)
    except (OSError, ValueError):  # not written yet, or its last line half written
        return {}
    return {r.step: r.fields.get("step_time_s") for r in records}


def stable_window(run_dir: Path, window: tuple[int, int], cv_bound: float) -> tuple[tuple[int, int], float] | None:
    """(the window cut at the last step recorded, its mean step time), once at least STABLE_MIN_STEPS of its steps
    are recorded and the coefficient of variation of their step times (``openrecipes measure``'s) is at most
    ``cv_bound``; None before."""
    from openrecipes.measure import metrics

    times = {step: seconds for step, seconds in _step_times(run_dir).items() if window[0] <= step <= window[1]}
    steps = 0
    while window[0] + steps in times and isinstance(times[window[0] + steps], (int, float)):
        steps += 1
    if steps < STABLE_MIN_STEPS:
        return None
    mean, _, cv = metrics.step_time_stats([times[window[0] + i] for i in range(steps)])
    return ((window[0], window[0] + steps - 1), mean) if cv <= cv_bound else None


def _ends_now(trial: TrialRun) -> tuple[int, int] | None:
    """The window a trial is measured over if it may end now (see TrialRun), else None."""
    if trial.steps is not None and trial.steps - 1 in _step_times(trial.run_dir):
        return trial.window
    if trial.stable_cv is None or trial.end_if_slower_than_s is None:
        return None
    stable = stable_window(trial.run_dir, trial.window, trial.stable_cv)
    if stable is None or stable[0][1] >= trial.window[1] or stable[1] <= trial.end_if_slower_than_s:
        return None
    return stable[0]


@dataclass(kw_only=True)
class Outcome:
    failure: str | None = None  # one of journal.FAILURE_CLASSES, None for a measured run
    detail: str = ""
    measured: dict[str, Any] | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None


class Runner(Protocol):
    def run(self, trial: TrialRun, tick: Callable[[float], None] | None = None) -> Outcome: ...


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b[^:\s]*:")
_OOM_MARKERS = ("out of memory", "outofmemoryerror", "can't allocate memory", "cannot allocate memory")


def classify_failure(returncode: int, log: str) -> tuple[str, str]:
    """(failure class, the line that says why) of a train process that did not succeed."""
    lines = [line for line in log.splitlines() if line.strip()]
    lower = log.lower()

    def line_with(*needles: str) -> str:
        return next((line.strip() for line in reversed(lines) if any(n in line.lower() for n in needles)),
                    lines[-1].strip() if lines else f"exit status {returncode}")

    if any(marker in lower for marker in _OOM_MARKERS):
        return "out_of_memory", line_with(*_OOM_MARKERS)
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and "traceback" not in lower:
        return "out_of_memory", f"killed by SIGKILL (exit status {returncode}), as the kernel's OOM killer does"
    if "non-finite loss" in lower:
        return "non_finite_loss", line_with("non-finite loss")
    if "openrecipes train: error:" in lower:  # train's user-error path: a recipe or layout it refuses
        return "refused_layout", line_with("openrecipes train: error:")
    # the first Python exception of a worker is the cause; the others (peers losing it, torchrun's summary) follow
    causes = [_RANK_PREFIX.sub("", line).strip() for line in lines]
    causes = [line for line in causes if _EXCEPTION_LINE.match(line) and "ChildFailedError" not in line]
    return "crash", causes[0] if causes else line_with("error", "exception")


def measure_trial(run_dir: Path, window: tuple[int, int]) -> dict[str, Any]:
    """The trial's numbers over the window (``openrecipes measure``), and its final loss. Raises ValueError with
    the class ``non_finite_loss`` in the message when a loss is not finite."""
    from openrecipes.config.rundir import METRICS_FILE, read_metrics
    from openrecipes.measure import measure_run_dir

    measured = measure_run_dir(run_dir, window=window)
    losses = [r.fields.get("loss") for r in read_metrics(run_dir / METRICS_FILE)]
    if not losses or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses):
        raise ValueError("non-finite or missing loss in metrics.jsonl")
    return {"tokens_per_s_per_gpu": measured.tokens_per_s_per_gpu, "step_time_mean_s": measured.step_time_mean_s,
            "step_time_cv": measured.step_time_cv, "peak_memory_gib": measured.peak_memory_gib,
            "peak_reserved_gib": measured.peak_reserved_gib,
            "gpu_type": measured.gpu_type, "gpus": measured.gpus, "final_loss": losses[-1],
            "window": tuple(measured.window)}


def measured_outcome(trial: TrialRun, wall_s: float) -> Outcome:
    """The outcome of a trial whose train process succeeded: its measurement, or why there is none."""
    try:
        measured = measure_trial(trial.run_dir, trial.window)
    except (ValueError, FileNotFoundError) as error:
        failure = "non_finite_loss" if "non-finite" in str(error) else "crash"
        return Outcome(failure=failure, detail=f"measure: {error}", wall_s=wall_s)
    return Outcome(measured=measured, wall_s=wall_s)


def _kill_group(process: subprocess.Popen) -> None:
    """Stop the trial and every process it started (torchrun and its workers share its session)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass(kw_only=True)
class LocalRunner:
    """Trials as processes on this machine: ``python -m openrecipes train RECIPE --nproc N``. With ``warm``, a
    one-process trial is forked from a process that has already imported torch and the engine (tune/zygote.py)."""

    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    poll_s: float = 0.25
    warm: bool = True
    # every trial compiles into this machine's compile cache: a trial rerun on shapes traced before skips compiling
    compile_cache_shared = True
    _zygote: Any = field(default=None, init=False, repr=False)

    def command(self, trial: TrialRun) -> list[str]:
        # a trial ends with the tuner, even a tuner killed with SIGKILL (its own session escapes Ctrl-C's group)
        return [self.python, "-m", "openrecipes", "train", str(trial.recipe_path), "--nproc", str(trial.nproc),
                "--exit-with-parent", str(os.getpid())]

    def _forked(self, trial: TrialRun, log_path: Path):
        """The trial forked from the warm process, or None where it runs as a command (several processes, a
        runner whose command was replaced, or a warm process that could not start)."""
        if not self.warm or trial.nproc != 1 or type(self).command is not LocalRunner.command:
            return None
        from openrecipes.tune.zygote import Zygote

        if self._zygote is not None and self._zygote.process.poll() is not None:
            return self._cold(f"the warm process ended (exit status {self._zygote.process.poll()})")
        if self._zygote is None:
            try:
                self._zygote = Zygote(self.python, env={**os.environ, **self.env})
            except (OSError, RuntimeError) as error:
                return self._cold(str(error))
            atexit.register(self._zygote.close)
        try:
            return self._zygote.fork(["train", str(trial.recipe_path), "--nproc", "1",
                                      "--exit-with-parent", str(self._zygote.pid)], log_path)
        except (OSError, RuntimeError) as error:  # it died between trials: its pipe is closed (BrokenPipeError)
            return self._cold(f"the warm process did not take the trial ({type(error).__name__}: {error})")

    def _cold(self, why: str) -> None:
        """From now on every trial starts as a new process; said once, in one line."""
        print(f"[tune] trials start as new processes: {why}", file=sys.stderr)
        self.warm, self._zygote = False, None

    def run(self, trial: TrialRun, tick: Callable[[float], None] | None = None) -> Outcome:
        log_path = trial.run_dir.parent / TRAIN_LOG
        started = time.monotonic()
        with open(log_path, "w") as log:
            # a session of its own, so a timeout stops torchrun's workers too
            process = self._forked(trial, log_path) or subprocess.Popen(
                self.command(trial), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                start_new_session=True)
            timed_out, stable = False, None
            try:
                while process.poll() is None:
                    elapsed = time.monotonic() - started
                    if elapsed > trial.timeout_s:
                        timed_out = True
                        _kill_group(process)
                        break
                    stable = _ends_now(trial)
                    if stable is not None:  # its figures are known: stop it
                        _kill_group(process)
                        break
                    if tick:
                        tick(elapsed)
                    try:
                        process.wait(timeout=self.poll_s)  # returns as soon as the trial exits
                    except subprocess.TimeoutExpired:
                        pass
            except BaseException:  # Ctrl-C: leave no orphaned workers behind
                _kill_group(process)
                raise
        wall = time.monotonic() - started
        text = log_path.read_text(errors="replace")
        if stable is not None:
            return measured_outcome(replace(trial, window=stable), wall)
        if timed_out:
            return Outcome(failure="timeout", detail=f"stopped after the trial limit of {trial.timeout_s:.0f} s",
                           wall_s=wall)
        if process.returncode != 0:
            failure, detail = classify_failure(process.returncode, text)
            return Outcome(failure=failure, detail=detail, wall_s=wall)
        return measured_outcome(trial, wall)

