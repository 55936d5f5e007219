"""Slurm jobs from this machine: submit a script (``sbatch --parsable``), read a job's state and identity
(``squeue -t all``, field by field), follow it to its end, cancel it only when it is ours.

A job's state is read from fields squeue prints for it alone (id, state, exit status, reason), never from a line of
free text: a job name, comment or folder holding ``JobState=COMPLETED`` cannot make a failed job read as completed,
and an answer that cannot be read is the state ``UNKNOWN``, never a final one. A job is ours (``JobIdentity``) when
the controller shows the name, user and script it was submitted with; nothing is cancelled on an id alone, since ids
are reused after a controller reset and on a shared cluster another job may hold one.

No accounting database is assumed: a finished job is read from the controller, which keeps it for ``MinJobAge``
(300 s by default), long enough for a follower that polls every few seconds.
"""

from __future__ import annotations

import os
import pwd
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
UNKNOWN = "UNKNOWN"  # a state squeue printed that could not be read: not final, never completed
# squeue's fields for a job's state, each ended by "|"; the reason, the only one that is not a number or a word, last
STATE_FORMAT = "JobID:|,State:|,exit_code:|,Reason:|"
_STATE_WORD = re.compile(r"[A-Z_]+")
# what the client commands print when no controller answers (a login node without one, a controller that is down)
_UNREACHABLE = ("unable to contact slurm controller", "could not establish a configuration source",
                "resolve_ctls_from_dns_srv", "connection refused", "communication connection failure")


class SlurmError(RuntimeError):
    """A Slurm client command failed or the controller stopped answering."""


@dataclass(frozen=True, kw_only=True)
class JobIdentity:
    """What makes a job ours: the name it was submitted under (unique to the script: a random token), the user who
    submitted it and the script's absolute path, as the controller reports them."""

    name: str
    user: str
    script: str

    def record(self) -> dict[str, str]:
        return {"job_name": self.name, "user": self.user, "script": self.script}

    @classmethod
    def from_record(cls, record: dict) -> "JobIdentity | None":
        """The identity written by ``record``; None when ``record`` lacks one (an older tool's, or damaged)."""
        values = [record.get(key) for key in ("job_name", "user", "script")]
        if not all(isinstance(value, str) and value for value in values):
            return None
        return cls(name=values[0], user=values[1], script=values[2])


def current_user() -> str:
    """The user name squeue reports for this process's jobs."""
    return pwd.getpwuid(os.getuid()).pw_name


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # as Slurm spells it, e.g. RUNNING, COMPLETED, CANCELLED
    reason: str = ""
    exit_code: int = 0  # the batch script's exit status
    signal: int = 0  # the signal that ended it, 0 for none

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


def _refusal(command: str, stderr: str) -> SlurmError:
    """The client's one-line error, said plainly when it is that no controller answers."""
    message = _first_line(stderr)
    if any(marker in stderr.lower() for marker in _UNREACHABLE):
        return SlurmError(f"no Slurm controller is reachable ({command}: {message})")
    return SlurmError(f"{command}: {message}")


def check_controller() -> None:
    """Raise SlurmError unless a controller answers (``sinfo``), before anything is written for it."""
    done = _client("sinfo", "-h", "-o", "%P")
    if done.returncode != 0:
        raise _refusal("sinfo", done.stderr)


def submit(script: Path, sbatch_args: tuple[str, ...] = (), identity: JobIdentity | None = None) -> str:
    """Queue ``script``; returns the job id (``sbatch --parsable`` prints ``ID`` or ``ID;CLUSTER``). With
    ``identity`` the job is named on the command line (over any SBATCH_JOB_NAME of the environment) and the script
    given by its recorded absolute path, so that the controller shows exactly that identity."""
    if identity is not None:
        if Path(identity.script) != Path(script).resolve():
            raise ValueError(f"{script} is not the script of {identity}")
        script, sbatch_args = Path(identity.script), ("--job-name", identity.name, *sbatch_args)
    done = _client("sbatch", "--parsable", *sbatch_args, str(script))
    if done.returncode != 0:
        raise _refusal(f"sbatch {script}", done.stderr)
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch {script}: expected a job id, got {done.stdout.strip()!r}")
    return job_id


def _check_id(job_id: str) -> None:
    if not (isinstance(job_id, str) and job_id.isdigit()):
        raise ValueError(f"not a Slurm job id: {job_id!r}")


def _squeue(job_id: str, *format_args: str) -> str | None:
    """squeue's answer for one job (any state the controller still keeps), None when it knows no such job."""
    _check_id(job_id)
    done = _client("squeue", "-h", "-t", "all", "-j", job_id, *format_args)
    if done.returncode != 0:
        if "invalid job id" in done.stderr.lower():
            return None
        raise _refusal(f"squeue -j {job_id}", done.stderr)
    return done.stdout if done.stdout.strip() else None


def parse_state(job_id: str, text: str) -> JobState:
    """The job's state from squeue's ``STATE_FORMAT`` answer: ``UNKNOWN`` unless its id, state word and exit status
    read as such (the wait status squeue prints holds the exit code and the signal)."""
    for line in text.splitlines():
        fields = line.split("|", 3)
        if len(fields) != 4 or fields[0].strip() != job_id:
            continue
        state, status = fields[1].strip(), fields[2].strip()
        if not _STATE_WORD.fullmatch(state) or not status.isdigit():
            break
        return JobState(job_id=job_id, state=state, reason=fields[3].strip().removesuffix("|").strip(),
                        exit_code=(int(status) >> 8) & 0xFF, signal=int(status) & 0x7F)
    return JobState(job_id=job_id, state=UNKNOWN, reason="squeue's answer could not be read")


def job_state(job_id: str) -> JobState | None:
    """The job as the controller knows it; None when it knows no such job (never queued, or long gone)."""
    answer = _squeue(job_id, "-O", STATE_FORMAT)
    return None if answer is None else parse_state(job_id, answer)


def job_identity(job_id: str) -> JobIdentity | None:
    """The name, user and script the controller shows for the job (None when it knows no such job). A user name
    holds no "|"; the name and the script path are each the whole of their own answer, whatever they hold."""
    owner, name, script = (_squeue(job_id, "-o", fmt) for fmt in ("%u", "%j", "%o"))
    if owner is None or name is None or script is None:
        return None
    return JobIdentity(name=name.removesuffix("\n"), user=owner.strip(), script=script.removesuffix("\n"))


def is_ours(job_id: str, identity: JobIdentity) -> bool:
    return job_identity(job_id) == identity


def find_job(identity: JobIdentity) -> str | None:
    """The id of the one job the controller shows as ``identity`` (found by its name and user, then checked whole);
    None when there is none, or more than one."""
    done = _client("squeue", "-h", "-t", "all", "--name", identity.name, "--user", identity.user, "-o", "%i")
    if done.returncode != 0:
        raise _refusal(f"squeue --name {identity.name}", done.stderr)
    ours = [job_id for job_id in done.stdout.split() if job_id.isdigit() and is_ours(job_id, identity)]
    return ours[0] if len(ours) == 1 else None


def cancel(job_id: str, identity: JobIdentity) -> bool:
    """``scancel`` this one job if the controller shows it as ``identity`` (its name, user and script), and then
    only under that name and user; False, and nothing cancelled, for any other job under that id."""
    if not is_ours(job_id, identity):
        return False
    done = _client("scancel", "--name", identity.name, "--user", identity.user, job_id)
    if done.returncode != 0:
        raise _refusal(f"scancel {job_id}", done.stderr)
    return True


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


def _output_tail(output: Path, lines: int = 5) -> list[str]:
    """The last lines of the job's output file (where the first failed worker's message lands)."""
    try:
        text = output.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def exit_status(state: JobState) -> int:
    """This command's exit status for the job's end: 0 only for COMPLETED, a failed script's own exit code."""
    if state.completed:
        return 0
    return state.exit_code if state.state == "FAILED" and 0 < state.exit_code < 256 else 1


def submit_and_follow(script: Path, identity: JobIdentity, output_dir: Path, *, poll_s: float,
                      deadline_s: float | None, sbatch_args: tuple[str, ...] = ()) -> int:
    """Submit ``script`` as ``identity``, follow the job with a line per new state, report its end (its output:
    ``output_dir/<job name>-<job id>.out``). Ctrl-C cancels the job, once the controller shows it as ours."""
    job_id = submit(script, sbatch_args, identity)
    output = output_dir / f"{identity.name}-{job_id}.out"
    print(f"submitted job {job_id} ({script}, name {identity.name})", flush=True)

    def progress(state: JobState, elapsed_s: float) -> None:
        print(f"job {job_id}: {state.describe()} after {elapsed_s:.0f} s", file=sys.stderr, flush=True)

    try:
        state = follow(job_id, poll_s=poll_s, deadline_s=deadline_s, on_change=progress)
    except KeyboardInterrupt:
        if not cancel(job_id, identity):
            print(f"interrupted: job {job_id} is no longer the job submitted as {identity.name}; nothing cancelled",
                  file=sys.stderr, flush=True)
            return 130
        print(f"interrupted: scancel {job_id}", file=sys.stderr, flush=True)
        state = follow(job_id, poll_s=min(poll_s, 1.0), deadline_s=120)
        print(f"job {job_id} {state.describe()} (cancelled on Ctrl-C)", flush=True)
        return 130
    except TimeoutError as waited:
        print(f"{waited}; it is left queued (scancel {job_id} stops it)", file=sys.stderr)
        return 1
    print(f"job {job_id} {state.describe()}; output: {output}", flush=True)
    if not state.completed:
        for line in _output_tail(output):
            print(f"  | {line}", file=sys.stderr)
    return exit_status(state)
