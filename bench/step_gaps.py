"""Where the GPU waits during one profiled step: the idle gaps of a Chrome trace (`debug.profile_timeline`).

Prints one JSON object: the span from the first to the last GPU activity, the time the GPU was busy (the union of
kernel, copy and set intervals), the idle total, and the longest gaps, each with the host operations that were running
through it (the outermost ones first: what the host was doing while the GPU had nothing queued).

Usage: python bench/step_gaps.py RUN_DIR/profile_trace.json [--top 15] [--min-gap-us 50]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation")


def gpu_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """Busy intervals of the GPU (µs), merged where they touch or overlap (several streams)."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATEGORIES)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def host_ops_through(events: list[dict], start: float, end: float, limit: int = 4) -> list[str]:
    """The host operations running across most of [start, end], longest (outermost) first."""
    covering = [e for e in events if e.get("cat") in HOST_CATEGORIES and e["ts"] < end
                and e["ts"] + e.get("dur", 0) > start]
    covering.sort(key=lambda e: -min(e["ts"] + e.get("dur", 0), end) + max(e["ts"], start))
    names: list[str] = []
    for event in covering:
        name = event["name"][:90]
        if name not in names:
            names.append(name)
        if len(names) == limit:
            break
    return names


def summarize(trace: Path, top: int, min_gap_us: float) -> dict:
    events = json.loads(trace.read_text())["traceEvents"]
    busy = gpu_intervals(events)
    if not busy:
        return {"trace": str(trace), "error": "no GPU activity in the trace"}
    gaps = [(prev[1], nxt[0]) for prev, nxt in zip(busy, busy[1:]) if nxt[0] - prev[1] >= min_gap_us]
    busy_us = sum(b - a for a, b in busy)
    span_us = busy[-1][1] - busy[0][0]
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    return {
        "trace": str(trace), "gpu_span_ms": span_us / 1e3, "gpu_busy_ms": busy_us / 1e3,
        "gpu_idle_ms": (span_us - busy_us) / 1e3, f"idle_in_gaps_over_{min_gap_us:g}us_ms":
        sum(b - a for a, b in gaps) / 1e3, "gaps_over_threshold": len(gaps),
        "longest_gaps": [{"at_ms": (a - busy[0][0]) / 1e3, "ms": (b - a) / 1e3,
                          "host": host_ops_through(events, a, b)} for a, b in longest],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--min-gap-us", type=float, default=50.0)
    args = parser.parse_args()
    print(json.dumps(summarize(args.trace, args.top, args.min_gap_us)))


if __name__ == "__main__":
    main()
