"""The layouts worth trying for a GPU count: every combination of sizes (and of first/last pipeline stage sizes)
that the layout rules (``config/layout.py`` ``layout_problems``) pass, for the planner's ranking and the tuner's
search space."""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Iterator

from openrecipes.config.layout import LayoutConfig, LayoutModel, LayoutWorkload, heads_problem, layout_problems


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, found in pairs up to its square root (a count of GPUs, so fast)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _stage_splits(num_layers: int, pp: int) -> Iterator[tuple[int | None, int | None]]:
    """(first, last) stage sizes worth trying: an even split, and symmetric lighter/heavier end stages."""
    if pp == 1:
        yield None, None
        return
    if num_layers % pp == 0:
        yield None, None
    if pp == 2:
        return
    for end in range(1, num_layers // 2 + 1):
        rest = num_layers - 2 * end
        if rest >= pp - 2 and rest % (pp - 2) == 0 and end != rest // (pp - 2):
            yield end, end


def enumerate_layouts(world_size: int, *, model: LayoutModel, max_tokens_per_gpu: int, max_tp: int = 8,
                      cp_options: Iterable[int] = (1, 2, 4, 8), etp_options: Iterable[int] = (1,), vpp: int = 1,
                      workload: LayoutWorkload | None = None) -> list[LayoutConfig]:
    """Every layout of ``model`` (its layer and expert counts given) for ``world_size`` GPUs that ``layout_problems``
    passes with ``workload`` (sequence parallel on whenever tp > 1); ``max_tp`` keeps TP inside a node."""
    if model.num_layers is None or model.num_experts is None:
        raise ValueError("enumerate_layouts needs the model's num_layers and num_experts")
    found: list[LayoutConfig] = []
    cps, etps = sorted(set(cp_options)), sorted(set(etp_options))
    for tp in divisors(world_size):
        if tp > max_tp or heads_problem(tp, model):  # the heads rule prunes every layout of this tp at once
            continue
        for pp in divisors(world_size // tp):
            if pp > model.num_layers:
                continue
            for cp in cps:
                if (world_size // (tp * pp)) % cp:
                    continue
                dp = world_size // (tp * pp * cp)
                for etp, ep in itertools.product(etps, divisors(model.num_experts)):
                    for first, last in _stage_splits(model.num_layers, pp):
                        layout = LayoutConfig(
                            tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, vpp=vpp,
                            sequence_parallel=tp > 1, pp_first_stage_layers=first,
                            pp_last_stage_layers=last, max_tokens_per_gpu=max_tokens_per_gpu)
                        if not layout_problems(layout, world_size=world_size, model=model, workload=workload):
                            found.append(layout)
    return found
