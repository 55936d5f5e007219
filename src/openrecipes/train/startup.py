"""Where a run's time goes before its steps: the seconds of each start-up phase, in ``startup.json``.

The tuner's trials are short runs, so what happens before step 0 (the interpreter and its imports, building the
model, allocating the optimizer's pinned host state, the first step's compilation) is most of their cost; this
record says which phase to cut. Rank 0 writes it once, after the first step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from openrecipes.config.rundir import STARTUP_FILE
from openrecipes.utils import atomic_write_text


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), or None where that is not known: the interpreter,
    its imports and, under torchrun, the launcher's spawn, all before ``train`` is called."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of proc(5), counted after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


class StartupClock:
    """Seconds per named phase, each from the previous mark (the first from the process's start)."""

    def __init__(self) -> None:
        launched = process_age_s()
        self.phases: dict[str, float] = {} if launched is None else {"launch": round(launched, 3)}
        self._last = time.monotonic()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self._last, 3)
        self._last = now

    def write(self, run_dir: Path) -> None:
        atomic_write_text(run_dir / STARTUP_FILE, json.dumps({"phases_s": self.phases}, indent=2) + "\n")

