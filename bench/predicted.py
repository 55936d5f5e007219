"""The planner's prediction beside each one-GPU engine sample of a `bench/run.py` results file: tokens/s/GPU and peak
allocated memory, predicted for the recipe the engine trained (bench/engine_speed.py's `recipe_tree`, the planner as
the tuner calls it: train/rank_cli.py `predicted`) on the results file's GPU, against the median of the measured
rounds. Prints a Markdown table, or JSON with --json.

Each row also carries the factor on the planner's compute time that would make its prediction the measurement
(``compute_scale``, the factor planner.yaml already applies for the family and GPU included). `--fit` turns the rows
of the runs named in FIT_ON into planner.yaml's ``openrecipes_engine.family_compute_scale`` (one factor per family and
GPU type) and shows every other row of the files given as held out.

Usage: python bench/predicted.py bench/results/families-h100.json [--json]
       python bench/predicted.py --fit bench/results/families-h100.json bench/results/families-none-h100.json ...
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
from workloads import family_of, load_workloads  # noqa: E402

# per GPU type, the one run of each family its compute scale is fitted on (compiled blocks, full recompute: the
# workloads the families were first measured in); the other runs of a family on that GPU are held out
FIT_ON = {"H100": {"gpt_oss": "gptoss_bal_c", "glm4_moe": "glm45_bal_c", "qwen3_5_moe": "qwen35_bal_c",
                   "deepseek_v3": "dsv3_bal_c"}}


def gpu_type(device_name: str) -> str:
    """The hardware table's GPU type a device name is (``NVIDIA H100 80GB HBM3`` -> ``H100``)."""
    known = sorted(hardware_table().gpus, key=len, reverse=True)  # H200 before H20, say
    for name in known:
        if name.lower() in device_name.lower().replace(" ", ""):
            return name
    raise ValueError(f"{device_name!r}: no GPU type of config/hardware.yaml in the name ({', '.join(known)})")


def compare(results: dict) -> list[dict]:
    from openrecipes.plan.hardware import load_hardware

    declared, gpu = load_workloads(), gpu_type(results["gpu"])
    engine = load_hardware(gpu).openrecipes_engine  # its family scales: what each prediction already applies
    rows = []
    for name in results["workloads"]:
        spec = declared[name].engine_spec()
        samples = [s for s in results["samples"] if s["workload"] == name and s["side"] == "engine"
                   and s.get("tokens_per_s_per_gpu")]
        if not samples or spec.get("nproc", 1) != 1:
            continue
        model, overrides, row_tokens = model_and_rows(spec, layers=8, tiny=False)
        family = family_of(model)
        with tempfile.TemporaryDirectory() as work:
            tree = recipe_tree(name, spec, layers=8, steps=spec.get("steps", 20), rows_dir=Path(work) / "rows",
                               workdir=Path(work), tiny=False)
            plan = predicted(recipe_from_dict(tree), resolve_model_config(model, overrides=overrides), gpu,
                             row_tokens)
        measured = statistics.median(s["tokens_per_s_per_gpu"] for s in samples)
        peak = max(s["peak_memory_gib"] for s in samples)  # the allocator's peak allocated, as the planner's
        rows.append({"workload": name, "gpu": gpu, "family": family, "rounds": len(samples),
                     "measured_tokens_per_s_per_gpu": measured,
                     "predicted_tokens_per_s_per_gpu": plan.throughput.tokens_per_s_per_gpu,
                     "measured_peak_gib": peak, "predicted_peak_gib": plan.stages[0].allocated_gib,
                     "compute_scale": compute_scale(plan, measured, engine.compute_scale(family, gpu))})
    return rows


def compute_scale(plan, measured_tokens_per_s: float, current: float) -> float:
    """The factor on the planner's compute time (``current``, planner.yaml's own for this family and GPU, included)
    that makes its one-GPU step the measured one: the step's time outside the pipeline (gradient sync, optimizer) kept
    as predicted, the pipeline (every microbatch's compute; nothing else on one GPU) scaled."""
    throughput = plan.throughput
    measured_step = throughput.step_time_s * throughput.tokens_per_s_per_gpu / measured_tokens_per_s
    # the unrounded compute (parts_s is rounded for display): one stage, every microbatch in turn
    pipeline = throughput.microbatches * throughput.stage_compute_s[0]
    return current * (measured_step - (throughput.step_time_s - pipeline)) / pipeline


def fit(rows: list[dict]) -> dict[str, dict[str, float]]:
    """planner.yaml's family_compute_scale from the rows of the runs FIT_ON names (family -> GPU -> factor)."""
    scales: dict[str, dict[str, float]] = {}
    for row in rows:
        if FIT_ON.get(row["gpu"], {}).get(row["family"]) == row["workload"]:
            scales.setdefault(row["family"], {})[row["gpu"]] = round(row["compute_scale"], 3)
    return scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fit", action="store_true", help="print planner.yaml's family_compute_scale fitted to the "
                                                           "FIT_ON runs, and the others held out")
    args = parser.parse_args()
    rows = [row for path in args.results for row in compare(json.loads(Path(path).read_text()))]
    if args.fit:
        print(json.dumps({"family_compute_scale": fit(rows)}, indent=1))
        rows = [r for r in rows if FIT_ON.get(r["gpu"], {}).get(r["family"]) != r["workload"]]
        print("held out (the planner as planner.yaml has it now):")
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
