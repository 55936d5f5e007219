"""The live display on stderr: the trial in progress, the best so far, the budget left.

On a terminal one status line is redrawn every second while a trial runs; otherwise (a log file, CI) only one line
per event is written, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, *, trials: int, minutes: float, stream: TextIO | None = None, quiet: bool = False) -> None:
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

    def trial_started(self, index: int, label: str, prediction: float | None) -> None:
        predicted = f", predicted {prediction:,.1f} tokens/s/GPU" if prediction else ""
        self.current = f"trial {index + 1}/{self.trials}: {label}"
        self._write(f"[tune] {self.current}{predicted}", line=True)

    def tick(self, elapsed_s: float) -> None:
        left = max(0.0, self.budget_s - self.used_s - elapsed_s)
        self._write(f"[tune] {self.current} running {elapsed_s:4.0f} s | {self._best_text()} | "
                    f"{left / 60:.1f} min left", line=False)

    def trial_finished(self, record: dict, *, reused: bool) -> None:
        self.used_s += record.get("wall_s", 0.0)
        measured = record.get("measured")
        if measured:
            tps = measured["tokens_per_s_per_gpu"]
            if record["key"] == "start":
                self.start_tps = tps
            if self.best is None or tps > self.best[0]:
                self.best = (tps, record["label"])
            result = f"{tps:,.1f} tokens/s/GPU"
        else:
            result = f"FAILED ({record['failure']['class']}: {record['failure']['detail'][:120]})"
        how = "reused from trials.jsonl" if reused else f"{record.get('wall_s', 0):.0f} s"
        left = max(0.0, self.budget_s - self.used_s) / 60
        self._write(f"[tune] trial {record['index'] + 1}: {result} [{how}] | {self._best_text()} | "
                    f"{left:.1f} min left", line=True)

    def elapsed_s(self) -> float:
        return self.used_s

    @staticmethod
    def clock() -> float:
        return time.monotonic()
