"""The card's per-step curves: the loss of both arms, and the candidate's step time, tokens/s/GPU and peak memory
per step, with its memory per stage of a step when the run traced it (``debug.memory_trace``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from openrecipes.config.rundir import METRICS_FILE, read_metrics


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def curve_points(curve: Any, run_dir: Path | None = None, gpus: int | None = None) -> list[dict[str, Any]]:
    """One point per finite loss; with ``run_dir`` (and its GPU count) also the step's time, tokens/s/GPU and peak
    memory from its metrics.jsonl, where recorded."""
    from openrecipes.verify.curves import is_finite

    records = {r.step: r.fields for r in read_metrics(run_dir / METRICS_FILE)} if run_dir else {}
    points = []
    for step in curve.steps():
        if not is_finite(curve.losses[step]):
            continue
        point: dict[str, Any] = {"step": step, "loss": curve.losses[step]}
        fields = records.get(step, {})
        time, tokens, memory = (_positive(fields.get(key)) for key in ("step_time_s", "tokens", "peak_memory_gib"))
        if time is not None:
            point["step_time_s"] = time
            if tokens is not None and gpus:
                point["tokens_per_s_per_gpu"] = tokens / time / gpus
        if memory is not None:
            point["peak_memory_gib"] = memory
        points.append(point)
    return points


def memory_phases(run_dir: Path, window: tuple[int, int]) -> dict[str, float] | None:
    """The memory per stage of the last step of ``window`` that has a memory trace, or None."""
    traced = [r for r in read_metrics(run_dir / METRICS_FILE)
              if window[0] <= r.step <= window[1] and isinstance(r.fields.get("memory_phases_gib"), dict)]
    if not traced:
        return None
    phases = traced[-1].fields["memory_phases_gib"]
    return {str(k): float(v) for k, v in phases.items()
            if not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0} or None
