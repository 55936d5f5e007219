"""A stalled rank ends the job: a heartbeat between steps, watched by a thread of the rank itself.

When one rank stops making progress between two steps (stuck in Python: a hung logger, a deadlock, an injected
``debug.stall_at``), the others wait for it in the next step's first collective until ``distributed_timeout_minutes``
(10 minutes by default) and then fail with a timeout that names no culprit. Instead each rank keeps a clock that runs
only between steps: it starts when a step returns and stops when the next step begins. Time inside a step (where a
rank may legitimately wait for the others in a collective) and inside a checkpoint save (which waits at barriers) is
not counted, so only the rank that stalled sees its clock run past ``heartbeat_timeout_seconds``. Its watchdog then
records the error for the launcher (rank, last finished step), prints it and ends the process; torchrun's agent stops
the other ranks and ``openrecipes train`` reports that rank first.

A rank stuck inside native code that holds the interpreter lock cannot run its watchdog; the collective timeout still
ends such a job. Single-process runs have no watchdog: nothing waits for them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator

from openrecipes.train.launch import record_worker_error


class StalledRank(TimeoutError):
    """A rank made no progress between two steps for longer than the recipe allows."""


class Heartbeat:
    """The between-steps clock of one rank and the thread that watches it (``enabled`` False: does nothing)."""

    def __init__(self, *, rank: int, timeout_s: float | None, enabled: bool) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic time the clock started; None while it is stopped
        self._step: int | None = None  # the last step this rank finished
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if enabled and timeout_s is not None:
            self._thread = threading.Thread(target=self._watch, name="openrecipes-heartbeat", daemon=True)
            self._thread.start()

    def step_done(self, step: int) -> None:
        """Step ``step`` has returned: the clock runs until the next step begins."""
        with self._lock:
            self._since, self._step = time.monotonic(), step

    def step_begins(self) -> None:
        with self._lock:
            self._since = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work between steps that waits for the other ranks (a checkpoint save): not counted."""
        with self._lock:
            since, self._since = self._since, None
        try:
            yield
        finally:
            with self._lock:
                self._since = None if since is None else time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            with self._lock:
                since, step = self._since, self._step
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._end(step)

    def _end(self, step: int | None) -> None:
        error = StalledRank(f"rank {self.rank} made no progress for {self.timeout_s:g} s after finishing step "
                            f"{step} (heartbeat_timeout_seconds); the job was ended instead of waiting for the "
                            "collective timeout")
        print(f"openrecipes train: {error}", file=sys.stderr, flush=True)
        record_worker_error(error)  # the launcher's summary names this rank first
        os._exit(1)  # the main thread is the one that is stuck: only ending the process frees the others
