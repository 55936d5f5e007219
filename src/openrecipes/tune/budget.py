"""The tuner's clock: what a trial is expected to take, and what the search holds back for the verification, the
remeasured pairs and the card that follow it (``--minutes`` is the wall time of the whole command)."""

from __future__ import annotations

from typing import Any

# verification besides the remeasured trials: the optimizer component test, the card and the site, in seconds
# (the component test took 11.6 s on two CPU cores; on one H200 210 s at the full CUDA shape, which the tuner no
# longer runs (tune/verification.py TUNER_COMPONENT_TEST); 60 s holds its eighth of the expert weights)
VERIFY_FIXED_S = {"cpu": 30.0, "gpu": 60.0}
CARD_S = 15.0  # the card and the site, what is left after the remeasurement


def verify_fixed_s(on_cpu: bool) -> float:
    return VERIFY_FIXED_S["cpu" if on_cpu else "gpu"]


def pairs_reserve_s(start_wall_s: float, winner_wall_s: float, remeasure: int, on_cpu: bool) -> float:
    """One remeasured (start, winner) pair, the least an honest gain needs (more are taken after the search as time
    allows), and the rest of verification."""
    return min(1, remeasure) * (start_wall_s + winner_wall_s) + verify_fixed_s(on_cpu)


def remeasure_pairs(pair_wall_s: float, left_s: float, remeasure: int, on_cpu: bool) -> int:
    """How many (start, winner) pairs to measure again: as many as ``remeasure`` asks that the time left holds after
    the rest of verification, and at least one."""
    fits = int((left_s - verify_fixed_s(on_cpu)) // max(pair_wall_s, 1e-9))
    return max(min(1, remeasure), min(remeasure, fits))


def estimated_wall_s(start: dict[str, Any], trial_steps: int, step_time_s: float | None) -> float:
    """A trial's expected wall time from the start's measured record: its cost before and around its steps plus
    the predicted steps (``step_time_s`` None: the start's own wall time)."""
    if step_time_s is None:
        return start["wall_s"]
    fixed = max(0.0, start["wall_s"] - trial_steps * start["measured"]["step_time_mean_s"])
    return fixed + trial_steps * step_time_s
