"""The card's per-step curves: the loss of both arms, and the candidate's step time, tokens/s/GPU, peak memory,
gradient norm and learning rate per step (of each pipeline stage too with layout.pp > 1), with its memory per stage of a step when the run traced it (``debug.memory_trace``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from openrecipes.config.rundir import METRICS_FILE, PEAK_MEMORY_PER_STAGE, read_metrics, stage_peaks


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def _non_negative(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def curve_points(curve: Any, run_dir: Path | None = None, gpus: int | None = None) -> list[dict[str, Any]]:
    """One point per finite loss; with ``run_dir`` (and its GPU count) also the step's time, tokens/s/GPU, peak
    memory (overall and per pipeline stage), gradient norm and learning rate from its metrics.jsonl, where
    recorded."""
    from openrecipes.verify.curves import is_finite

    records = {r.step: r for r in read_metrics(run_dir / METRICS_FILE)} if run_dir else {}
    points = []
    for step in curve.steps():
        if not is_finite(curve.losses[step]):
            continue
        point: dict[str, Any] = {"step": step, "loss": curve.losses[step]}
        record = records.get(step)
        fields = record.fields if record else {}
        time, tokens, memory = (_positive(fields.get(key)) for key in ("step_time_s", "tokens", "peak_memory_gib"))
        if time is not None:
            point["step_time_s"] = time
            if tokens is not None and gpus:
                point["tokens_per_s_per_gpu"] = tokens / time / gpus
        if memory is not None:
            point["peak_memory_gib"] = memory
        for key in ("grad_norm", "lr"):
            if (value := _non_negative(fields.get(key))) is not None:
                point[key] = value
        stages = stage_peaks(record, run_dir / METRICS_FILE) if record else None
        if stages is not None:
            point[PEAK_MEMORY_PER_STAGE] = stages
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


def window_stage_peaks(run_dir: Path, window: tuple[int, int]) -> list[float] | None:
    """The largest peak of each pipeline stage over the steps of ``window`` that record one, or None."""
    path = run_dir / METRICS_FILE
    peaks: list[float] | None = None
    for record in read_metrics(path):
        stages = stage_peaks(record, path) if window[0] <= record.step <= window[1] else None
        if stages is None:
            continue
        if peaks is not None and len(stages) != len(peaks):
            raise ValueError(f"{path}:{record.line}: step {record.step}: {len(stages)} stages in "
                             f"'{PEAK_MEMORY_PER_STAGE}', earlier steps have {len(peaks)}")
        peaks = stages if peaks is None else [max(a, b) for a, b in zip(peaks, stages)]
    return peaks
