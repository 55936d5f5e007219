"""What one ``openrecipes tune`` command was asked: the start, the output, the target and the budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True)
class TuneOptions:
    start: Path
    out: Path
    gpus: str = "auto"
    trials: int = 12
    minutes: float = 30.0
    trial_steps: int = 20
    window: tuple[int, int] | None = None  # default: trial_window(trial_steps)
    nproc: int | None = None
    trial_timeout_s: float = 900.0
    tries: tuple[str, ...] = ()  # "KEY=VALUE KEY=VALUE": candidates measured right after the start
    author: str = "openrecipes tune"
    remeasure: int = 2  # interleaved (start, winner) pairs measured again before publishing (tune/remeasure.py)
    # a trial ends once its window's first steps vary less than this (runner.stable_window); None: all its steps
    stable_cv: float | None = 0.02
    # one device's memory the planner fits candidates into, instead of the device's (or, on CPU, the host's share)
    gpu_memory_gib: float | None = None
    # earlier tunings' calibration.json (files, tuner outputs or directories of them): the first prediction starts
    # from the one of this model family and GPU type (tune/family_calibration.py)
    calibrations: tuple[Path, ...] = ()
    # the start and the planner's first ``screen`` candidates measured one rank at a time before any trial, those
    # whose measured peak does not fit pruned (tune/screen.py); 0: no screen
    screen: int = 0

    def measurement_window(self) -> tuple[int, int]:
        return self.window or trial_window(self.trial_steps)


def trial_window(steps: int) -> tuple[int, int]:
    """The measurement window of a trial of ``steps`` steps: steps 5 to the last (the cards' 5-19 of 20), starting
    earlier for short trials so at least half of the steps are measured."""
    if steps < 3:
        raise ValueError(f"--trial-steps: at least 3 steps are needed (a warm-up step and a window), got {steps}")
    return min(5, steps // 2), steps - 1
