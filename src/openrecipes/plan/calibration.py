"""The planner beside this engine's measured runs: `bench/engine_speed.py` results turned back into layouts.

Each result of `bench/engine_speed.py` records its variant's settings (GPUs, dp/ep/tp/cp, optimizer, offload,
layers, rows per microbatch) and what was measured (tokens/s/GPU, peak allocated memory). `measured_runs` reads
them, `fit_engine_calibration` fits the three numbers of planner.yaml's ``openrecipes_engine`` block, each from
one run named in ``FITTED_ON``, and `compare` evaluates every run with ``--engine openrecipes``: the runs not
named there are held out. `bench/plan_calibration.py` prints and saves the table.
"""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from openrecipes.config.layout import LayoutConfig
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import EngineCalibration, Hardware
from openrecipes.plan.memory import TrainingSetup

ROW_TOKENS = 8192  # bench/engine_speed.py's rows on the GPU

# calibration field -> the variant whose measured speed fits it
FITTED_ON = {"tp_s_per_layer": "tp2_pa_bal", "cp_s_per_layer": "cp2_pa_bal",
             "cpu_adam_elements_per_s_per_rank": "dp2ep2_pa_off_bal"}

# result files (or file:variant) whose speed no one reads, the planner's calibration nor bench/report.py (the home of
# this list: src cannot read bench/), and why (single_bal of -1gpu-h200-final also profiled step 10 inside its window,
# but that step took 0.215 s against 0.204-0.209 s: kept)
SUPERSEDED = {
    "2026-11-29-engine_speed-1gpu-h200-previous.json": "an earlier version of the engine (rerun: -final)",
    "2026-11-29-engine_speed-4gpu-h200-profiled-in-window.json": "the profiled step inside the timing window (rerun)",
    "2026-11-29-engine_speed-4gpu-h200-memory-trace.json": "a two-step timing window, run for its memory phases",
    "2026-11-29-engine_speed-2gpu-h200.json:dp2ep2_bal": "the profiled step inside the timing window",
    "2026-11-29-engine_speed-2gpu-h200-offload.json": "before the CPU update moved to slices (rerun: -offload-sliced)",
}
# runs of knobs the planner's model leaves out (compiled blocks, recompute other than full, offload streamed through
# the GPU, Muse Spark), and one call whose variants shared a process
_KNOBS_NOT_MODELLED = {
    f"2026-12-01-speed-{call}-engine_speed-h200.json": "compiled blocks, other recompute modes, streamed offload "
    "and Muse Spark: knobs and a model the calibration table does not describe" for call in "abc"} | {
    name: "compiled blocks and recompute other than full: knobs the calibration table does not describe" for name in (
        "2026-12-01-e-engine_speed-h200.json", "2026-12-01-h-engine_speed-packed-c-h200.json",
        "2026-12-01-h-engine_speed-nat-h200.json:single_nat_c_none")}
NOT_FOR_SPEED = {**SUPERSEDED, **_KNOBS_NOT_MODELLED}
NOT_FOR_MEMORY = {
    "2026-11-29-engine_speed-2gpu-h200-offload.json": "the same layout as the -sliced rerun",
    "2026-11-29-engine_speed-1gpu-h200-previous.json": "an earlier version of the engine",
    "2026-11-29-engine_speed-4gpu-h200-profiled-in-window.json": "superseded by the rerun",
    "2026-11-29-engine_speed-4gpu-h200-seed48.json": "its peak includes building the whole model (see the trace)",
    **_KNOBS_NOT_MODELLED,
    "2026-11-29-engine_speed-1gpu-h200-final.json:packed_bal": "ran after another variant in the same process",
    **{f"2026-11-29-engine_speed-4gpu-h200-memory-trace.json:{v}": "the same run as in -final.json"
       for v in ("dp2_pa_bal", "dp2ep2_pa_bal", "dp4ep4_pa_bal")},
}


@dataclass(kw_only=True, frozen=True)
class MeasuredRun:
    source: str
    variant: str
    gpu: str = ""  # the result's device name ("NVIDIA H200")
    layers: int
    layout: LayoutConfig
    setup: TrainingSetup
    tokens_per_s_per_gpu: float | None  # None: not comparable (NOT_FOR_SPEED)
    peak_allocated_gib: float | None  # the training peak; None: not comparable (NOT_FOR_MEMORY)

    @property
    def measured_step_s(self) -> float | None:
        if self.tokens_per_s_per_gpu is None:
            return None
        return self.setup.global_batch_tokens / self.layout.world_size / self.tokens_per_s_per_gpu


@dataclass(kw_only=True, frozen=True)
class Comparison:
    run: MeasuredRun
    predicted_tokens_per_s_per_gpu: float
    predicted_allocated_gib: float
    fitted: bool  # the run fitted a calibration number

    @property
    def throughput_error(self) -> float | None:
        measured = self.run.tokens_per_s_per_gpu
        return None if measured is None else self.predicted_tokens_per_s_per_gpu / measured - 1

    @property
    def memory_error(self) -> float | None:
        measured = self.run.peak_allocated_gib
        return None if measured is None else self.predicted_allocated_gib / measured - 1


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


def _excluded(table: dict[str, str], source: str, variant: str) -> bool:
    return source in table or f"{source}:{variant}" in table


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
    variant = result["variant"]
    peak = result["measure"]["peak_memory_gib"]
    phases = [p for p in result.get("memory_phases_gib") or [] if p]
    if phases:  # rank 0's training peak, without the model build
        peak = max(v for p in phases for k, v in p.items() if k.endswith("_peak"))
    return MeasuredRun(
        source=source, variant=variant, gpu=str(report.get("gpu", "")), layers=result.get("layers", report["layers"]),
        layout=layout, setup=setup,
        tokens_per_s_per_gpu=None if _excluded(NOT_FOR_SPEED, source, variant)
        else result["measure"]["tokens_per_s_per_gpu"],
        peak_allocated_gib=None if _excluded(NOT_FOR_MEMORY, source, variant) else peak)


def _predict(run: MeasuredRun, hw: Hardware, model: str):
    from openrecipes.models.registry import get_config
    from openrecipes.plan.shape import model_shape

    shape = model_shape(replace(get_config(model), num_hidden_layers=run.layers))
    return evaluate(shape, run.layout, run.setup, hw)


def fit_engine_calibration(runs: list[MeasuredRun], hw: Hardware, model: str = "qwen3-30b-a3b"
                           ) -> EngineCalibration:
    """Each number of ``openrecipes_engine`` from its run in ``FITTED_ON``: what the model without it misses of the
    measured step time, per layer and microbatch (TP, CP), or the CPU optimizer rate that makes up the gap."""
    by_variant = {r.variant: r for r in runs if r.tokens_per_s_per_gpu is not None}
    missing = sorted(v for v in FITTED_ON.values() if v not in by_variant)
    if missing:
        raise ValueError(f"calibration: no usable measurement of {', '.join(missing)} in bench/results")
    base = replace(hw, openrecipes_engine=EngineCalibration(tp_s_per_layer=0.0, cp_s_per_layer=0.0,
                                                            cpu_adam_elements_per_s_per_rank=1e30))
    values = {}
    for field in ("tp_s_per_layer", "cp_s_per_layer"):
        run = by_variant[FITTED_ON[field]]
        plan = _predict(run, base, model)
        gap = run.measured_step_s - plan.throughput.step_time_s
        values[field] = max(0.0, gap / (plan.throughput.microbatches * max(plan.stage_layers)))
    # the step time falls as the CPU rate rises (until the PCIe copies bound it): bisect the rate in log space
    run = by_variant[FITTED_ON["cpu_adam_elements_per_s_per_rank"]]
    low, high = 1e3, 1e13
    for _ in range(100):
        rate = (low * high) ** 0.5
        trial = replace(base, openrecipes_engine=replace(base.openrecipes_engine,
                                                         cpu_adam_elements_per_s_per_rank=rate))
        low, high = (rate, high) if _predict(run, trial, model).throughput.step_time_s > run.measured_step_s \
            else (low, rate)
    values["cpu_adam_elements_per_s_per_rank"] = (low * high) ** 0.5
    # the families' compute scales are fitted on their own runs (bench/predicted.py --fit), kept as they are
    kept = hw.openrecipes_engine.family_compute_scale if hw.openrecipes_engine else {}
    return EngineCalibration(**values, family_compute_scale=kept)


def compare(runs: list[MeasuredRun], hw: Hardware, model: str = "qwen3-30b-a3b") -> list[Comparison]:
    fitted = set(FITTED_ON.values())
    out = []
    for run in runs:
        plan = _predict(run, hw, model)
        out.append(Comparison(run=run, predicted_tokens_per_s_per_gpu=plan.throughput.tokens_per_s_per_gpu,
                              predicted_allocated_gib=max(s.allocated_gib for s in plan.stages),
                              fitted=run.variant in fitted and run.tokens_per_s_per_gpu is not None))
    return out


@functools.lru_cache(maxsize=4)
def held_out_errors(results_dir: str, planner_path: str | None = None) -> dict[str, tuple[list[float], int]]:
    """Per GPU: the sorted relative errors of this engine's predicted tokens/s/GPU on its GPU runs under
    ``results_dir`` held out of the calibration, and how many runs it was fitted on. Cached: a ranking and its tests
    ask again with the same files."""
    from openrecipes.config.hardware import known_gpu_name
    from openrecipes.plan.hardware import load_hardware

    runs = measured_runs(Path(results_dir)) if Path(results_dir).is_dir() else []
    by_gpu: dict[str, list[MeasuredRun]] = {}
    for run in runs:
        if run.tokens_per_s_per_gpu is not None:
            by_gpu.setdefault(known_gpu_name(run.gpu), []).append(run)
    out = {}
    for gpu, group in sorted(by_gpu.items()):
        comparisons = compare(group, load_hardware(gpu, path=planner_path))
        errors = sorted(abs(c.throughput_error) for c in comparisons if not c.fitted)
        if errors:
            out[gpu] = (errors, len(comparisons) - len(errors))
    return out


def speed_error(results_dir: str, gpu: str, planner_path: str | None = None) -> float | None:
    """The worst held-out error of this engine's predictions on ``gpu`` (``held_out_errors``), None unmeasured."""
    from openrecipes.config.hardware import known_gpu_name

    found = held_out_errors(results_dir, planner_path).get(known_gpu_name(gpu))
    return found[0][-1] if found else None


def speed_error_line(results_dir: str, planner_path: str | None = None) -> str:
    """One line beside a plan: how far this engine's predicted tokens/s/GPU were from its GPU runs under
    ``results_dir`` held out of the calibration (worst and median), how many and on which GPU; or that none was
    found."""
    parts = [f"within {errors[-1]:.1%} (median {statistics.median(errors):.1%}) on {len(errors)} held-out {gpu} runs "
             f"(and {fitted} it was fitted on)"
             for gpu, (errors, fitted) in held_out_errors(results_dir, planner_path).items()]
    if not parts:
        return (f"prediction error: unknown, no measured GPU run of this engine under {results_dir} "
                "(--bench-results)")
    return (f"prediction error of this engine's tokens/s/GPU (bench/plan_calibration.py): {'; '.join(parts)}; "
            "other GPUs and the generic model: not measured")
