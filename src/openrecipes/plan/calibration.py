"""The planner beside this engine's measured runs: `bench/engine_speed.py` results turned back into layouts.

Each result of `bench/engine_speed.py` records its variant's settings (GPUs, dp/ep/tp/cp, optimizer, offload,
layers, rows per microbatch) and what was measured (tokens/s/GPU, peak allocated memory). `measured_runs` reads
them; `compare` evaluates each with `--engine openrecipes` and returns predicted against measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from openrecipes.parallel.layout import LayoutConfig
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import Hardware
from openrecipes.plan.memory import TrainingSetup

ROW_TOKENS = 8192  # bench/engine_speed.py's rows on the GPU


@dataclass(kw_only=True, frozen=True)
class MeasuredRun:
    source: str
    variant: str
    layers: int
    layout: LayoutConfig
    setup: TrainingSetup
    tokens_per_s_per_gpu: float
    peak_allocated_gib: float


@dataclass(kw_only=True, frozen=True)
class Comparison:
    run: MeasuredRun
    predicted_tokens_per_s_per_gpu: float
    predicted_allocated_gib: float

    @property
    def throughput_error(self) -> float:
        return self.predicted_tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu - 1

    @property
    def memory_error(self) -> float:
        return self.predicted_allocated_gib / self.run.peak_allocated_gib - 1


def measured_runs(results_dir: Path) -> list[MeasuredRun]:
    """Every successful GPU result of bench/engine_speed.py under ``results_dir``."""
    runs = []
    for path in sorted(Path(results_dir).glob("*engine_speed*.json")):
        report = json.loads(path.read_text())
        if report.get("benchmark") != "engine_speed" or report.get("gpu") == "cpu":
            continue
        for result in report["results"]:
            if "error" in result or not result.get("measure", {}).get("tokens_per_s_per_gpu"):
                continue
            runs.append(_run_from_result(path.name, report, result))
    return runs


def _run_from_result(source: str, report: dict, result: dict) -> MeasuredRun:
    nproc = result.get("nproc", 1)
    tp, cp = result.get("tp", 1), result.get("cp", 1)
    rows = result.get("rows_per_microbatch", 1)
    layout = LayoutConfig(dp=result.get("dp", nproc // (tp * cp)), ep=result.get("ep", 1), tp=tp, cp=cp,
                          sequence_parallel=tp > 1, max_tokens_per_gpu=ROW_TOKENS * rows // cp,
                          rows_per_microbatch=rows)
    precision_aware = result.get("precision_aware", nproc == 1)
    setup = TrainingSetup(recompute="full", optimizer="precision-aware" if precision_aware else "adam",
                          offload_fraction=result.get("offload", 0.0), engine="openrecipes",
                          global_batch_tokens=result["rows_per_step"] * ROW_TOKENS)
    measure = result["measure"]
    return MeasuredRun(source=source, variant=result["variant"], layers=result.get("layers", report["layers"]),
                       layout=layout, setup=setup, tokens_per_s_per_gpu=measure["tokens_per_s_per_gpu"],
                       peak_allocated_gib=measure["peak_memory_gib"])


def compare(runs: list[MeasuredRun], hw: Hardware, model: str = "qwen3-30b-a3b") -> list[Comparison]:
    from openrecipes.models.registry import get_config
    from openrecipes.plan.shape import model_shape

    out = []
    for run in runs:
        shape = model_shape(replace(get_config(model), num_hidden_layers=run.layers))
        plan = evaluate(shape, run.layout, run.setup, hw)
        out.append(Comparison(run=run, predicted_tokens_per_s_per_gpu=plan.throughput.tokens_per_s_per_gpu,
                              predicted_allocated_gib=max(s.allocated_gib for s in plan.stages)))
    return out
