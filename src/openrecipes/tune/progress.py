"""The live display on stderr: the trial in progress, the best so far, the budget left, and the clock of the
budget: ``--minutes`` is the wall time of the whole command, from the start of the search to the site.

On a terminal one status line is redrawn every second while a trial runs; otherwise (a log file, CI) only one line
per event is written, so logs stay readable.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Callable, TextIO

from openrecipes.tune.journal import SEARCH_PHASES


def failure_text(failure: dict, limit: int = 160) -> str:
    """A trial's failure in one line, "class: detail", the detail cut at a word near ``limit`` characters."""
    detail = " ".join(str(failure["detail"]).split())
    if len(detail) > limit:
        detail = detail[:limit].rsplit(" ", 1)[0] + " …"
    return f"{failure['class']}: {detail}"


def trial_name(index: int, phase: str | None, trials: int) -> str:
    """A trial as the card, trials.jsonl and the trials/ folders number it (0: the start), with what it is: one of
    the ``--trials`` of the search, or a remeasured or ablated run after it."""
    if phase in SEARCH_PHASES:
        return f"trial {index} ({index + 1} of {trials})"
    return f"trial {index} ({phase})" if phase else f"trial {index}"


class Progress:
    def __init__(self, *, trials: int, minutes: float, stream: TextIO | None = None, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.reserve_s = 0.0  # held back for verification and the interleaved remeasurement
        self.stream = stream or sys.stderr
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.quiet = quiet
        self.trials, self.budget_s = trials, minutes * 60.0
        self.best: tuple[float, str] | None = None
        self.start_tps: float | None = None
        self.used_s = 0.0
        self.current = ""
        self._drawn = False

    def _best_text(self) -> str:
        if self.best is None:
            return "best: none yet"
        tps, label = self.best
        gain = f" ({tps / self.start_tps - 1:+.1%} on the start)" if self.start_tps else ""
        return f"best {tps:,.1f} tokens/s/GPU{gain}: {label}"

    def _write(self, text: str, *, line: bool) -> None:
        if self.quiet:
            return
        if self.live:
            self.stream.write("\r\033[K" + text + ("\n" if line else ""))
            self._drawn = not line
        elif line:
            self.stream.write(text + "\n")
        self.stream.flush()

    def say(self, text: str) -> None:
        self._write(f"[tune] {text}", line=True)

    def trial_started(self, index: int, label: str, prediction: float | None, phase: str = "ranked") -> None:
        predicted = f", predicted {prediction:,.1f} tokens/s/GPU" if prediction else ""
        self.current = f"{trial_name(index, phase, self.trials)}: {label}"
        self._write(f"[tune] {self.current}{predicted}", line=True)

    def _left_text(self) -> str:
        left = max(0.0, self.budget_s - self.elapsed_s())
        reserved = f", {self.reserve_s / 60:.1f} of them for verification" if self.reserve_s else ""
        return f"{left / 60:.1f} min left{reserved}"

    def tick(self, elapsed_s: float) -> None:
        self._write(f"[tune] {self.current} running {elapsed_s:4.0f} s | {self._best_text()} | "
                    f"{self._left_text()}", line=False)

    def projected_finish(self, remaining_s: float) -> None:
        """Say when the command should end: now plus ``remaining_s`` (the trials still planned and the reserve)."""
        at = datetime.datetime.now() + datetime.timedelta(seconds=remaining_s)
        self.say(f"projected finish {at:%H:%M:%S} ({(self.elapsed_s() + remaining_s) / 60:.1f} of "
                 f"{self.budget_s / 60:g} minutes)")

    def trial_finished(self, record: dict, *, reused: bool) -> None:
        self.used_s += record.get("wall_s", 0.0)
        measured = record.get("measured")
        if measured:
            tps = measured["tokens_per_s_per_gpu"]
            if record.get("phase") == "start":  # the start, or the reference measured in its place
                self.start_tps = tps
            # the best of the search: a remeasured or ablated run is another sample, not another candidate
            if record.get("phase") in SEARCH_PHASES and (self.best is None or tps > self.best[0]):
                self.best = (tps, record["label"])
            result = f"{tps:,.1f} tokens/s/GPU" + _memory_text(measured, record.get("prediction"))
        else:
            result = f"FAILED ({failure_text(record['failure'])})"
        how = "reused from trials.jsonl" if reused else f"{record.get('wall_s', 0):.0f} s"
        if not reused and record.get("overhead_s") is not None:
            how += f", {record['overhead_s']:.0f} s of it beyond its steps at their mean time"
            # start-up runs to the end of the first step (its compilation too): not a breakdown of the figure above
            if record.get("startup_s"):
                how += ("; start-up to the end of the first step: "
                        + ", ".join(f"{phase} {s:.0f} s" for phase, s in record["startup_s"].items()))
        name = trial_name(record["index"], record.get("phase"), self.trials)
        self._write(f"[tune] {name}: {result} [{how}] | {self._best_text()} | "
                    f"{self._left_text()}", line=True)

    def elapsed_s(self) -> float:
        """Wall time since the command started (trials reused from an earlier run take none)."""
        return self.clock() - self.started

    def left_s(self) -> float:
        return self.budget_s - self.elapsed_s()


def _memory_text(measured: dict, prediction: dict | None) -> str:
    """The trial's peak memory beside the one the search expected for it, when both are known."""
    peak = measured.get("peak_memory_gib")
    # allocated against allocated: the measured peak is torch's peak allocated memory
    expected = (prediction or {}).get("calibrated_allocated_gib")
    if not peak:
        return ""
    if not expected:
        return f", peak {peak:.1f} GiB"
    return f", peak {peak:.1f} GiB (predicted {expected:.1f}, {100 * (expected / peak - 1):+.1f} %)"
