"""The planner's prediction beside each one-GPU engine sample of a `bench/run.py` results file: tokens/s/GPU and peak
allocated memory, predicted for the recipe the engine trained (bench/engine_speed.py's `recipe_tree`, the planner as
the tuner calls it: train/rank_cli.py `predicted`) on the results file's GPU, against the median of the measured
rounds. Prints a Markdown table, or JSON with --json.

Usage: python bench/predicted.py bench/results/families-h100.json [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from engine_speed import model_and_rows, recipe_tree  # noqa: E402
from openrecipes.config.hardware import load_hardware as hardware_table  # noqa: E402
from openrecipes.config.recipe import recipe_from_dict  # noqa: E402
from openrecipes.models.resolve import resolve_model_config  # noqa: E402
from openrecipes.train.rank_cli import predicted  # noqa: E402
from workloads import load_workloads  # noqa: E402


def gpu_type(device_name: str) -> str:
    """The hardware table's GPU type a device name is (``NVIDIA H100 80GB HBM3`` -> ``H100``)."""
    known = sorted(hardware_table().gpus, key=len, reverse=True)  # H200 before H20, say
    for name in known:
        if name.lower() in device_name.lower().replace(" ", ""):
            return name
    raise ValueError(f"{device_name!r}: no GPU type of config/hardware.yaml in the name ({', '.join(known)})")


def compare(results: dict) -> list[dict]:
    declared, gpu = load_workloads(), gpu_type(results["gpu"])
    rows = []
    for name in results["workloads"]:
        spec = declared[name].engine_spec()
        samples = [s for s in results["samples"] if s["workload"] == name and s["side"] == "engine"
                   and s.get("tokens_per_s_per_gpu")]
        if not samples or spec.get("nproc", 1) != 1:
            continue
        model, overrides, row_tokens = model_and_rows(spec, layers=8, tiny=False)
        with tempfile.TemporaryDirectory() as work:
            tree = recipe_tree(name, spec, layers=8, steps=spec.get("steps", 20), rows_dir=Path(work) / "rows",
                               workdir=Path(work), tiny=False)
            plan = predicted(recipe_from_dict(tree), resolve_model_config(model, overrides=overrides), gpu,
                             row_tokens)
        measured = statistics.median(s["tokens_per_s_per_gpu"] for s in samples)
        peak = max(s["peak_memory_gib"] for s in samples)  # the allocator's peak allocated, as the planner's
        rows.append({"workload": name, "gpu": gpu, "rounds": len(samples), "measured_tokens_per_s_per_gpu": measured,
                     "predicted_tokens_per_s_per_gpu": plan.throughput.tokens_per_s_per_gpu,
                     "measured_peak_gib": peak, "predicted_peak_gib": plan.stages[0].allocated_gib})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = compare(json.loads(Path(args.results).read_text()))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| workload | measured tokens/s/GPU | predicted | error | measured peak GiB | predicted | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        speed = r["predicted_tokens_per_s_per_gpu"] / r["measured_tokens_per_s_per_gpu"] - 1
        peak = r["predicted_peak_gib"] / r["measured_peak_gib"] - 1
        print(f"| `{r['workload']}` | {r['measured_tokens_per_s_per_gpu']:,.0f} | "
              f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {speed:+.1%} | {r['measured_peak_gib']:.1f} | "
              f"{r['predicted_peak_gib']:.1f} | {peak:+.1%} |")


if __name__ == "__main__":
    main()
