"""Trials as Slurm jobs: one sbatch script per trial (srun + torchrun, the launcher's writer
``openrecipes.train.sbatch.write_sbatch``), submitted with the trial's time limit and followed to its end; the job's
output is the trial's train.log.

A job outlives the tuner that submitted it, so its identity (name with a random token, user, script) is written into
the trial's folder (``slurm-job.json``) before it is queued, and its id the moment sbatch answers. A rerun of the
same tune command follows a job that is still queued or running, or takes the measurement of one that completed
meanwhile, instead of submitting the trial again (``resumable``), but only a job the controller shows with that
identity: a job id alone (reused after a controller reset, or another user's) is never followed or cancelled. Up to
``max_parallel`` jobs run at once during the search (``InFlight``); the first that ends is collected first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from openrecipes.train.slurm import JobIdentity
from openrecipes.tune.runner import TRAIN_LOG, Outcome, TrialRun, classify_failure, measured_outcome

if TYPE_CHECKING:
    from openrecipes.train.sbatch import SbatchScript

JOB_FILE = "slurm-job.json"
# a Slurm job's end other than COMPLETED or FAILED, as a trial's failure class (journal.FAILURE_CLASSES)
SLURM_FAILURES = {"TIMEOUT": "timeout", "CANCELLED": "cancelled", "NODE_FAIL": "node_fail",
                  "PREEMPTED": "preempted", "OUT_OF_MEMORY": "out_of_memory"}
# the cluster's doing, not the recipe's: the search prunes no candidate for them
CLUSTER_FAILURES = ("cancelled", "node_fail", "preempted")
# how late Slurm may end a job past its --time (its limit check runs about every 30 s, then KillWait): a job's
# --time is this much below the trial's limit, so Slurm's own TIMEOUT comes before the tuner's scancel
SLURM_ENFORCE_S = 60.0
# what an earlier tuner's job may be in for a rerun to follow it (or take its measurement) instead of running the
# trial again; a job that ended otherwise (cancelled on Ctrl-C, failed unwatched) is run again
FOLLOWED_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                   "COMPLETED")


def slurm_minutes(timeout_s: float) -> str:
    """sbatch's --time for a trial limit: whole minutes that end at least SLURM_ENFORCE_S before it (at least 1)."""
    return str(max(1, math.floor((timeout_s - SLURM_ENFORCE_S) / 60)))


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    trial: TrialRun | None  # None only while an earlier tuner's job is looked up, before it is given its trial
    job_id: str
    identity: JobIdentity
    submitted: float  # time.time() when it was queued (by this tuner or an earlier one)
    adopted: bool = False  # queued by an earlier tuner

    @property
    def deadline(self) -> float:
        """The trial's limit as a time.monotonic() instant: queued time counts, as the budget is wall time."""
        return time.monotonic() + self.trial.timeout_s - (time.time() - self.submitted)


def _recorded_job(trial_dir: Path) -> tuple[str | None, JobIdentity, float] | None:
    """(job id, or None before sbatch answered; identity; submit time) written into ``trial_dir`` for its job, None
    without a readable one (an older tuner's record holds no identity: its job is not followed)."""
    try:
        record = json.loads((trial_dir / JOB_FILE).read_text())
        job_id, submitted = record.get("job_id"), float(record["submitted"])
        identity = JobIdentity.from_record(record)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if identity is None or not (job_id is None or (isinstance(job_id, str) and job_id.isdigit())):
        return None
    return job_id, identity, submitted


def _followed_job(trial_dir: Path) -> SlurmJob | None:
    """The recorded job of ``trial_dir`` when the controller shows it with the recorded identity and says it is
    queued, running or completed; a job under the recorded id that is not that one is left alone, with a line."""
    from openrecipes.train.slurm import find_job, is_ours, job_state

    recorded = _recorded_job(trial_dir)
    if recorded is None:
        return None
    job_id, identity, submitted = recorded
    if job_id is None:  # the tuner stopped between sbatch and recording its answer: the job is found by its name
        job_id = find_job(identity)
        if job_id is None:
            return None
    elif not is_ours(job_id, identity):
        print(f"openrecipes tune: {trial_dir.name}: job {job_id} is not the job recorded in {JOB_FILE} (its name, user "
              "or script differ); it is left alone and the trial runs anew", file=sys.stderr, flush=True)
        return None
    state = job_state(job_id)
    if state is None or state.state not in FOLLOWED_STATES:
        return None
    return SlurmJob(trial=None, job_id=job_id, identity=identity, submitted=submitted, adopted=True)


@dataclass(kw_only=True)
class SlurmRunner:
    """Trials as Slurm jobs of nodes of ``gpus_per_node``, up to ``max_parallel`` at once during the search."""

    gpus_per_node: int
    partition: str | None = None
    account: str | None = None
    cpu: bool = False  # workers on CPU: no GPUs requested (a CPU partition, a test cluster)
    cpus_per_task: int = 16
    poll_s: float = 5.0
    max_parallel: int = 1
    # a trial's node may not hold the compile cache of the trials before it: a rerun may compile again
    compile_cache_shared = False

    def __post_init__(self) -> None:
        from openrecipes.train.sbatch import slurm_names

        if self.max_parallel < 1:
            raise ValueError(f"--max-parallel: at least 1 trial job at once, got {self.max_parallel}")
        for option, value in (("--slurm-partition", self.partition), ("--slurm-account", self.account)):
            if value is not None:
                slurm_names(option, value)

    def script(self, trial: TrialRun) -> "SbatchScript":
        from openrecipes.train.sbatch import write_sbatch

        if trial.nproc % self.gpus_per_node:
            raise ValueError(f"--nproc: {trial.nproc} processes are not whole nodes of {self.gpus_per_node} GPUs")
        out = trial.run_dir.parent / "trial.sbatch"
        return write_sbatch(str(trial.recipe_path), out, nodes=trial.nproc // self.gpus_per_node,
                            gpus_per_node=self.gpus_per_node, overrides=[], partition=self.partition,
                            account=self.account, time=slurm_minutes(trial.timeout_s),
                            cpus_per_task=self.cpus_per_task, cpu=self.cpu)

    def resumable(self, trial_dir: Path) -> Path | None:
        """The folder of an earlier tuner's job for this trial (same key, any index) that is still queued or
        running or has completed: the trial is followed there rather than started again in ``trial_dir``."""
        index, _, key = trial_dir.name.partition("-")
        if not trial_dir.parent.is_dir() or not index.isdigit():
            return None
        same = re.compile(r"\d{3,}-" + re.escape(key))
        earlier = sorted(p for p in trial_dir.parent.iterdir() if same.fullmatch(p.name) and (p / JOB_FILE).is_file())
        return next((p for p in ([trial_dir] if trial_dir in earlier else []) + earlier if _followed_job(p)), None)

    def check_out(self, out: Path) -> None:
        """Refuse an output folder the trials' scripts and sbatch's --output cannot hold (one line, naming --out)."""
        from openrecipes.train.sbatch import slurm_filename

        slurm_filename("--out", out.resolve())

    def start(self, trial: TrialRun) -> SlurmJob:
        """Queue the trial's job, or follow the one an earlier tuner queued for it (see ``resumable``)."""
        from openrecipes.train.sbatch import slurm_filename
        from openrecipes.train.slurm import submit

        trial_dir = trial.run_dir.parent
        earlier = _followed_job(trial_dir)
        if earlier is not None:
            return dataclasses.replace(earlier, trial=trial)
        script = self.script(trial)
        submitted = time.time()
        _record_job(trial_dir, None, script.identity, submitted)  # before sbatch: a job is never left unnamed
        # not requeued after a node failure: the trial ends as node_fail, and its folder is not written twice
        output = slurm_filename("--out", (trial_dir / TRAIN_LOG).resolve())
        job_id = submit(script.path, ("--output", output, "--no-requeue"), script.identity)
        _record_job(trial_dir, job_id, script.identity, submitted)
        return SlurmJob(trial=trial, job_id=job_id, identity=script.identity, submitted=submitted)

    def wait_any(self, jobs: list[SlurmJob], tick: Callable[[float], None] | None = None) -> tuple[SlurmJob, Outcome]:
        """Follow the jobs until one ends (or passes its trial's limit: cancelled); that job and its outcome."""
        from openrecipes.train.slurm import cancel, follow_any

        by_id = {job.job_id: job for job in jobs}
        state = follow_any({job.job_id: job.deadline for job in jobs}, poll_s=self.poll_s, on_poll=tick)
        job = by_id[state.job_id]
        wall = time.time() - job.submitted
        if not state.final:
            done = "cancelled" if cancel(job.job_id, job.identity) else "no longer ours (not cancelled)"
            return job, Outcome(failure="timeout", detail=f"job {job.job_id} {done} at the trial limit of "
                                                          f"{job.trial.timeout_s:.0f} s", wall_s=wall)
        if state.state in SLURM_FAILURES:
            return job, Outcome(failure=SLURM_FAILURES[state.state], detail=f"job {job.job_id} {state.describe()}",
                                wall_s=wall)
        if not state.completed:
            log_path = job.trial.run_dir.parent / TRAIN_LOG
            text = log_path.read_text(errors="replace") if log_path.is_file() else ""
            failure, detail = (classify_failure(state.exit_code or 1, text) if state.state == "FAILED"
                               else ("crash", f"job {job.job_id} {state.describe()}"))
            return job, Outcome(failure=failure, detail=detail, wall_s=wall)
        return job, measured_outcome(job.trial, wall)

    def run(self, trial: TrialRun, tick: Callable[[float], None] | None = None) -> Outcome:
        job = self.start(trial)
        try:
            return self.wait_any([job], tick)[1]
        except BaseException:  # Ctrl-C, or the controller lost: the job must not run on unwatched
            cancel_jobs([job])
            raise


def _record_job(trial_dir: Path, job_id: str | None, identity: JobIdentity, submitted: float) -> None:
    from openrecipes.utils import atomic_write_text

    record = {"job_id": job_id, "submitted": submitted, **identity.record()}
    atomic_write_text(trial_dir / JOB_FILE, json.dumps(record) + "\n")


def cancel_jobs(jobs: list[SlurmJob]) -> None:
    """scancel each job that is still ours; a controller that does not answer leaves the error that stopped the
    tuner."""
    from openrecipes.train.slurm import SlurmError, cancel

    for job in jobs:
        with contextlib.suppress(SlurmError):
            cancel(job.job_id, job.identity)


class InFlight:
    """The search's trials whose jobs are queued or running (up to ``max_parallel``), each with what the search
    needs to record it."""

    def __init__(self, runner: Any, max_parallel: int) -> None:
        self.runner, self.max_parallel = runner, max_parallel  # a SlurmRunner when max_parallel > 1
        self.jobs: dict[str, tuple[SlurmJob, Any]] = {}

    @property
    def count(self) -> int:
        return len(self.jobs)

    def submit(self, trial: TrialRun, pending: Any) -> None:
        job = self.runner.start(trial)
        self.jobs[job.job_id] = (job, pending)

    def collect(self, tick: Callable[[float], None] | None = None) -> tuple[Any, Outcome]:
        """The first trial to end: its pending record and outcome."""
        job, outcome = self.runner.wait_any([job for job, _ in self.jobs.values()], tick)
        return self.jobs.pop(job.job_id)[1], outcome

    def cancel(self) -> None:
        cancel_jobs([job for job, _ in self.jobs.values()])
        self.jobs.clear()

    def __enter__(self) -> "InFlight":
        return self

    def __exit__(self, *error: object) -> None:
        """Whatever stops the search (Ctrl-C, a refused sbatch, a lost controller) cancels the jobs in flight."""
        self.cancel()


def resumable_trial_dir(runner: object, trial_dir: Path) -> Path | None:
    """Where an earlier tuner's job for this trial is followed instead of the trial starting afresh in
    ``trial_dir``: only Slurm jobs outlive their tuner (a local trial ends with it)."""
    return runner.resumable(trial_dir) if isinstance(runner, SlurmRunner) else None
