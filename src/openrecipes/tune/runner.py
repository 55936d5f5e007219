"""Trials as real runs: ``openrecipes train`` in its own process (torchrun for several), a time limit, then the
measurement of ``openrecipes measure``.

``LocalRunner`` runs on this machine. ``SlurmRunner`` submits one sbatch script per trial, the launcher's Slurm
template (``openrecipes.train.launch.write_sbatch``), for clusters larger than one machine, and follows the job.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
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
            "gpu_type": measured.gpu_type, "gpus": measured.gpus, "final_loss": losses[-1]}


def _measured(trial: TrialRun, wall_s: float) -> Outcome:
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
    """Trials as processes on this machine: ``python -m openrecipes train RECIPE --nproc N``."""

    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    poll_s: float = 1.0

    def command(self, trial: TrialRun) -> list[str]:
        # a trial ends with the tuner, even a tuner killed with SIGKILL (its own session escapes Ctrl-C's group)
        return [self.python, "-m", "openrecipes", "train", str(trial.recipe_path), "--nproc", str(trial.nproc),
                "--exit-with-parent", str(os.getpid())]

    def run(self, trial: TrialRun, tick: Callable[[float], None] | None = None) -> Outcome:
        log_path = trial.run_dir.parent / TRAIN_LOG
        started = time.monotonic()
        with open(log_path, "w") as log:
            # a session of its own, so a timeout stops torchrun's workers too
            process = subprocess.Popen(self.command(trial), stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **self.env}, start_new_session=True)
            timed_out = False
            try:
                while process.poll() is None:
                    elapsed = time.monotonic() - started
                    if elapsed > trial.timeout_s:
                        timed_out = True
                        _kill_group(process)
                        break
                    if tick:
                        tick(elapsed)
                    time.sleep(self.poll_s)
            except BaseException:  # Ctrl-C: leave no orphaned workers behind
                _kill_group(process)
                raise
        wall = time.monotonic() - started
        text = log_path.read_text(errors="replace")
        if timed_out:
            return Outcome(failure="timeout", detail=f"stopped after the trial limit of {trial.timeout_s:.0f} s",
                           wall_s=wall)
        if process.returncode != 0:
            failure, detail = classify_failure(process.returncode, text)
            return Outcome(failure=failure, detail=detail, wall_s=wall)
        return _measured(trial, wall)


# a Slurm job's end other than COMPLETED or FAILED, as a trial's failure class
SLURM_FAILURES = {"TIMEOUT": "timeout", "CANCELLED": "cancelled", "NODE_FAIL": "node_fail",
                  "PREEMPTED": "preempted", "OUT_OF_MEMORY": "out_of_memory"}


def slurm_minutes(timeout_s: float) -> str:
    """sbatch's --time for a trial limit: whole minutes, rounded up (Slurm enforces it within about a minute)."""
    return str(max(1, math.ceil(timeout_s / 60)))


@dataclass(kw_only=True)
class SlurmRunner:
    """Trials as Slurm jobs: one sbatch script per trial (srun + torchrun, the launcher's template), submitted with
    the trial's time limit and followed to its end; the job's output is the trial's train.log."""

    gpus_per_node: int
    partition: str | None = None
    account: str | None = None
    cpu: bool = False  # workers on CPU: no GPUs requested (a CPU partition, a test cluster)
    cpus_per_task: int = 16
    poll_s: float = 5.0

    def script(self, trial: TrialRun) -> Path:
        from openrecipes.train.launch import write_sbatch

        if trial.nproc % self.gpus_per_node:
            raise ValueError(f"--nproc: {trial.nproc} processes are not whole nodes of {self.gpus_per_node} GPUs")
        out = trial.run_dir.parent / "trial.sbatch"
        return write_sbatch(str(trial.recipe_path), out, nodes=trial.nproc // self.gpus_per_node,
                            gpus_per_node=self.gpus_per_node, overrides=[], partition=self.partition,
                            account=self.account, time=slurm_minutes(trial.timeout_s),
                            cpus_per_task=self.cpus_per_task, cpu=self.cpu)

    def run(self, trial: TrialRun, tick: Callable[[float], None] | None = None) -> Outcome:
        from openrecipes.train.slurm import cancel, follow, submit

        log_path = trial.run_dir.parent / TRAIN_LOG
        started = time.monotonic()
        job_id = submit(self.script(trial), ("--output", str(log_path.resolve())))
        try:
            # queued time counts: the trial's limit is wall time, as the local runner's, and ends with the budget
            state = follow(job_id, poll_s=self.poll_s, deadline_s=trial.timeout_s, on_poll=tick)
        except TimeoutError:
            cancel(job_id)
            return Outcome(failure="timeout", detail=f"job {job_id} cancelled at the trial limit of "
                                                     f"{trial.timeout_s:.0f} s", wall_s=time.monotonic() - started)
        except BaseException:  # Ctrl-C, or the controller lost: the job must not run on unwatched
            cancel(job_id)
            raise
        wall = time.monotonic() - started
        if state.state in SLURM_FAILURES:
            return Outcome(failure=SLURM_FAILURES[state.state], detail=f"job {job_id} {state.describe()}",
                           wall_s=wall)
        if not state.completed:
            text = log_path.read_text(errors="replace") if log_path.is_file() else ""
            failure, detail = (classify_failure(state.exit_code or 1, text) if state.state == "FAILED"
                               else ("crash", f"job {job_id} {state.describe()}"))
            return Outcome(failure=failure, detail=detail, wall_s=wall)
        return _measured(trial, wall)
