"""Continuous knobs solved from the memory model instead of enumerated.

Two knobs trade speed for memory monotonically: the optimizer offload fraction (more offloaded, less device memory,
more host-link time) and the number of layers recomputed whole (more layers, less memory, more compute). The fastest
setting of either is the least one that fits, so the tuner asks the (refitted) memory model for it: the smallest
fraction on a grid of ``FRACTION_STEP`` and the fewest layers whose predicted peak leaves the refit's margin of the
device free (``Calibration.memory_margin``: 5 %, less once measured peaks warrant it). Both are found by bisection
over the planner's predictions; 0 and 1 (and none and every layer) stay candidates of their own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from openrecipes.tune.space import FRACTION_STEP, Settings

BLOCK_GRANULARITIES = ("full", "experts")  # recompute granularities the engine applies to the first N layers

Fits = Callable[[Settings], bool | None]  # True / False, or None when the planner refuses the settings


def least_fitting(fits: Callable[[int], bool | None], lo: int, hi: int) -> int | None:
    """The least ``n`` in ``[lo, hi]`` with ``fits(n)``, assuming fitting is monotone in ``n``; None when even ``hi``
    does not fit (or is refused)."""
    if not fits(hi):
        return None
    if fits(lo):
        return lo
    while hi - lo > 1:  # fits(hi) and not fits(lo)
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def solved_offload(settings: Settings, fits: Fits) -> Settings | None:
    """``settings`` with the smallest offload fraction that fits (a multiple of FRACTION_STEP), or None when no
    fraction does."""
    steps = round(1 / FRACTION_STEP)
    found = least_fitting(lambda n: fits(replace(settings, offload=round(n * FRACTION_STEP, 6))), 0, steps)
    return None if found is None else replace(settings, offload=round(found * FRACTION_STEP, 6))


def solved_recompute_layers(settings: Settings, fits: Fits, num_layers: int) -> list[Settings]:
    """For each block granularity: ``settings`` with the fewest leading layers recomputed that fits (none when even
    all but the last do not: every layer is the uniform setting, a candidate of its own)."""
    found = []
    if num_layers < 2:
        return found
    for granularity in BLOCK_GRANULARITIES:
        def at(n: int, granularity: str = granularity) -> Settings:
            return replace(settings, recompute=(granularity, "block", n))

        fewest = least_fitting(lambda n: fits(at(n)), 1, num_layers - 1)
        if fewest is not None:
            found.append(at(fewest))
    return found
