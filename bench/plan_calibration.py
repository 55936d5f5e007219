"""Fit the planner's `openrecipes_engine` numbers to our measured runs and compare every run with the prediction.

Reads the `bench/engine_speed.py` results under bench/results (H200), fits each number of planner.yaml's
`openrecipes_engine` block from its run (`openrecipes.plan.calibration.FITTED_ON`), and writes the comparison of
every run (fitted or held out; throughput and training peak memory) as JSON and as a Markdown table.

Usage: python bench/plan_calibration.py [--results bench/results] [--out plan-calibration.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from openrecipes.plan.calibration import compare, fit_engine_calibration, measured_runs  # noqa: E402
from openrecipes.plan.hardware import load_hardware  # noqa: E402
from openrecipes.utils import atomic_write_text  # noqa: E402


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "logs" / "plan-calibration.json"))
    args = parser.parse_args()
    hw = load_hardware("H200")
    runs = measured_runs(Path(args.results))
    fitted = fit_engine_calibration(runs, hw)
    rows = []
    for c in compare(runs, replace(hw, openrecipes_engine=fitted)):
        if c.run.tokens_per_s_per_gpu is None and c.run.peak_allocated_gib is None:
            continue
        rows.append({"source": c.run.source, "variant": c.run.variant, "layout": c.run.layout.label(), "layers": c.run.layers,
                     "optimizer": c.run.setup.optimizer, "fitted": c.fitted,
                     "measured_tokens_per_s_per_gpu": c.run.tokens_per_s_per_gpu,
                     "predicted_tokens_per_s_per_gpu": round(c.predicted_tokens_per_s_per_gpu, 1),
                     "throughput_error": c.throughput_error, "measured_peak_allocated_gib": c.run.peak_allocated_gib,
                     "predicted_allocated_gib": round(c.predicted_allocated_gib, 2), "memory_error": c.memory_error})
    atomic_write_text(Path(args.out), json.dumps({"fitted": asdict(fitted), "runs": rows}, indent=2) + "\n")
    print("fitted:", asdict(fitted))
    print("| run | layers | measured tok/s/GPU | predicted | error | measured peak GiB | predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = r["measured_tokens_per_s_per_gpu"]
        peak = r["measured_peak_allocated_gib"]
        print(f"| {r['variant']} ({r['layout']}){' **fitted**' if r['fitted'] else ''} | {r['layers']} | "
              f"{'–' if measured is None else f'{measured:,.0f}'} | {r['predicted_tokens_per_s_per_gpu']:,.0f} | "
              f"{_percent(r['throughput_error'])} | {'–' if peak is None else f'{peak:.1f}'} | "
              f"{r['predicted_allocated_gib']:.1f} | {_percent(r['memory_error'])} |")


if __name__ == "__main__":
    main()
