"""Slurm jobs from this machine: submit a script (``sbatch --parsable``), read a job's state (``scontrol show job``,
then ``squeue -t all``), follow it to its end, cancel it by id.

No accounting database is assumed: a finished job is read from the controller, which keeps it for ``MinJobAge``
(300 s by default), long enough for a follower that polls every few seconds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# the states a job does not leave; anything else (PENDING, CONFIGURING, RUNNING, COMPLETING, SUSPENDED...) goes on
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE")
COMMAND_TIMEOUT_S = 30  # one client command; a controller that is down makes them hang for seconds
# the signal Slurm reports for a job its cgroup's OOM killer ended (ExitCode=0:125): a marker, not a signal sent
OOM_SIGNAL = 125
_FIELD = re.compile(r"(?:^|\s)(JobState|Reason|ExitCode|StdOut)=(\S*)")


class SlurmError(RuntimeError):
    """A Slurm client command failed or the controller stopped answering."""


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # as Slurm spells it, e.g. RUNNING, COMPLETED, CANCELLED
    reason: str = ""
    exit_code: int = 0  # the batch script's exit status
    signal: int = 0  # the signal that ended it, 0 for none
    stdout: str | None = None  # the job's output file, as the controller knows it

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def completed(self) -> bool:
        return self.state == "COMPLETED"

    def describe(self) -> str:
        """One phrase: the state and why, e.g. ``FAILED (exit code 3)``, ``CANCELLED``, ``PENDING (Resources)``."""
        details = []
        if self.final and not self.completed and self.exit_code:
            details.append(f"exit code {self.exit_code}")
        # a cancel or time limit always sends 15; an OOM kill's marker says no more than the state does
        if self.state in ("FAILED", "OUT_OF_MEMORY") and self.signal and not (
                self.state == "OUT_OF_MEMORY" and self.signal == OOM_SIGNAL):
            details.append(f"signal {self.signal}")
        if not self.final and self.reason not in ("", "None"):
            details.append(self.reason)
        detail = ", ".join(details)
        return f"{self.state} ({detail})" if detail else self.state


def _client(*command: str) -> subprocess.CompletedProcess:
    if shutil.which(command[0]) is None:
        raise SlurmError(f"{command[0]} is not on PATH: is this a Slurm login node?")
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as expired:
        raise SlurmError(f"{' '.join(command)} did not answer within {COMMAND_TIMEOUT_S} s") from expired


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no message")


def submit(script: Path, sbatch_args: tuple[str, ...] = ()) -> str:
    """Queue ``script``; returns the job id (``sbatch --parsable`` prints ``ID`` or ``ID;CLUSTER``)."""
    done = _client("sbatch", "--parsable", *sbatch_args, str(script))
    if done.returncode != 0:
        raise SlurmError(f"sbatch {script}: {_first_line(done.stderr)}")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch {script}: expected a job id, got {done.stdout.strip()!r}")
    return job_id


def cancel(job_id: str) -> None:
    """``scancel`` this one job (by id: never a user's or a name's jobs)."""
    if not job_id.isdigit():
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    done = _client("scancel", job_id)
    if done.returncode != 0:
        raise SlurmError(f"scancel {job_id}: {_first_line(done.stderr)}")


def parse_scontrol(job_id: str, text: str) -> JobState | None:
    """The state in ``scontrol show job -o``'s line (None when it has no JobState)."""
    fields = dict(_FIELD.findall(text))
    if "JobState" not in fields:
        return None
    exit_code, _, signal = fields.get("ExitCode", "0:0").partition(":")
    return JobState(job_id=job_id, state=fields["JobState"], reason=fields.get("Reason", ""),
                    exit_code=int(exit_code or 0), signal=int(signal or 0), stdout=fields.get("StdOut"))


def job_state(job_id: str) -> JobState | None:
    """The job as the controller knows it; None when it knows no such job (never queued, or long gone)."""
    shown = _client("scontrol", "show", "job", "-o", job_id)
    if shown.returncode == 0:
        state = parse_scontrol(job_id, shown.stdout)
        if state is not None:
            return state
    elif "invalid job id" not in shown.stderr.lower():
        raise SlurmError(f"scontrol show job {job_id}: {_first_line(shown.stderr)}")
    queued = _client("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T")
    if queued.returncode != 0 and "invalid job id" not in queued.stderr.lower():
        raise SlurmError(f"squeue -j {job_id}: {_first_line(queued.stderr)}")
    state = queued.stdout.strip()
    return JobState(job_id=job_id, state=state) if queued.returncode == 0 and state else None


def follow_any(deadlines: dict[str, float | None], *, poll_s: float = 2.0, unreachable_s: float = 120.0,
               on_change: Callable[[JobState, float], None] | None = None,
               on_poll: Callable[[float], None] | None = None) -> JobState:
    """Poll the jobs (by id, each with a deadline: a ``time.monotonic()`` instant, or None) until one reaches a final
    state or passes its deadline, and return that job's last state: final, or not (its deadline passed; the job is
    left as it is). ``on_change(state, elapsed_s)`` hears each job's new state, ``on_poll(elapsed_s)`` each look.
    Raises SlurmError when the controller does not answer for ``unreachable_s`` seconds or forgets a job."""
    start = last_answer = time.monotonic()
    seen: dict[str, JobState] = {}
    while True:
        now = time.monotonic()
        try:
            states = [(job_id, job_state(job_id)) for job_id in deadlines]
            last_answer = now
        except SlurmError:  # a controller restarting or busy: ask again until it has been silent too long
            if now - last_answer > unreachable_s:
                raise
            time.sleep(poll_s)
            continue
        for job_id, state in states:
            if state is None:
                raise SlurmError(f"the controller knows no job {job_id}")
            if state != seen.get(job_id) and on_change is not None:
                on_change(state, now - start)
            seen[job_id] = state
        ended = [state for _, state in states if state.final]
        if ended:
            return ended[0]
        late = [seen[job_id] for job_id, deadline in deadlines.items() if deadline is not None and now > deadline]
        if late:
            return late[0]
        if on_poll is not None:
            on_poll(now - start)
        time.sleep(poll_s)


def follow(job_id: str, *, poll_s: float = 2.0, deadline_s: float | None = None, unreachable_s: float = 120.0,
           on_change: Callable[[JobState, float], None] | None = None,
           on_poll: Callable[[float], None] | None = None) -> JobState:
    """Poll the job until it reaches a final state and return that state (``follow_any`` of one job). Raises
    TimeoutError after ``deadline_s`` seconds (the job is left as it is)."""
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    state = follow_any({job_id: deadline}, poll_s=poll_s, unreachable_s=unreachable_s, on_change=on_change,
                       on_poll=on_poll)
    if not state.final:
        raise TimeoutError(f"job {job_id} is still {state.state} after {deadline_s:.0f} s")
    return state


def _output_tail(state: JobState, lines: int = 5) -> list[str]:
    """The last lines of the job's output file (where the first failed worker's message lands)."""
    if not state.stdout:
        return []
    try:
        text = Path(state.stdout).read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def exit_status(state: JobState) -> int:
    """This command's exit status for the job's end: 0 only for COMPLETED, a failed script's own exit code."""
    if state.completed:
        return 0
    return state.exit_code if state.state == "FAILED" and 0 < state.exit_code < 256 else 1


def submit_and_follow(script: Path, *, poll_s: float, deadline_s: float | None) -> int:
    """Submit ``script``, follow the job with a line per new state, report its end. Ctrl-C cancels the job."""
    job_id = submit(script)
    print(f"submitted job {job_id} ({script})", flush=True)

    def progress(state: JobState, elapsed_s: float) -> None:
        print(f"job {job_id}: {state.describe()} after {elapsed_s:.0f} s", file=sys.stderr, flush=True)

    try:
        state = follow(job_id, poll_s=poll_s, deadline_s=deadline_s, on_change=progress)
    except KeyboardInterrupt:
        print(f"interrupted: scancel {job_id}", file=sys.stderr, flush=True)
        cancel(job_id)
        state = follow(job_id, poll_s=min(poll_s, 1.0), deadline_s=120)
        print(f"job {job_id} {state.describe()} (cancelled on Ctrl-C)", flush=True)
        return 130
    except TimeoutError as waited:
        print(f"{waited}; it is left queued (scancel {job_id} stops it)", file=sys.stderr)
        return 1
    print(f"job {job_id} {state.describe()}" + (f"; output: {state.stdout}" if state.stdout else ""), flush=True)
    if not state.completed:
        for line in _output_tail(state):
            print(f"  | {line}", file=sys.stderr)
    return exit_status(state)
