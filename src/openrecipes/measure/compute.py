"""Measure one run directory: the window metrics of docs/measure.md from run.json + metrics.jsonl."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openrecipes.measure import metrics as m
from openrecipes.config.hardware import (HardwareTable, Price, is_cpu, load_hardware, resolve_price,
                                        usd_per_million_tokens)
from openrecipes.config.rundir import (
    METRICS_FILE,
    RUN_FILE,
    RunInfo,
    RunModelInfo,
    StepRecord,
    read_metrics,
    read_run_info,
    require_number,
)

DEFAULT_WINDOW = (5, 19)


@dataclass(kw_only=True)
class Measurement:
    window: tuple[int, int]
    window_steps: int
    window_tokens: int
    window_time_s: float
    gpu_type: str
    gpus: int
    tokens_per_s_per_gpu: float
    step_time_mean_s: float
    step_time_std_s: float
    step_time_cv: float
    step_time_std_kind: str = "population (ddof=0)"
    active_params: int | None = None
    peak_flops_per_gpu: float | None = None
    mfu: float | None = None
    model_tflops_per_gpu: float | None = None
    usd_per_gpu_hour: float | None = None
    price_source: str | None = None
    usd_per_million_tokens: float | None = None
    steps_recorded: int = 0
    total_step_time_s: float = 0.0
    gpu_hours: float = 0.0
    gpu_hours_note: str = "GPUs x sum of all recorded step times; excludes startup and checkpoint time"
    peak_memory_gib: float | None = None
    peak_reserved_gib: float | None = None  # the caching allocator's peak: what had to fit the device
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["window"] = list(self.window)
        return data


def default_window(records: list[StepRecord], metrics_origin: str = METRICS_FILE) -> tuple[int, int]:
    """The window a run has: steps 5-19 (the seeds' window; steps 0-4 are warm-up) when it reached step 19, else
    steps 5 to its last step; a run that never reached step 5 needs an explicit window."""
    first, last = DEFAULT_WINDOW
    reached = max((record.step for record in records), default=-1)
    if reached >= first:
        return first, min(last, reached)
    raise ValueError(f"{metrics_origin}: the run recorded steps up to {reached}, and the default window starts at "
                     f"step {first} (steps 0-{first - 1} are warm-up); give --window FIRST LAST (0-based, "
                     "inclusive) to measure it")


def compute_metrics(
    run: RunInfo,
    records: list[StepRecord],
    *,
    window: tuple[int, int] | None = None,
    gpu_type: str | None = None,
    hardware: HardwareTable | None = None,
    price: Price | None = None,
    run_origin: str = RUN_FILE,
    metrics_origin: str = METRICS_FILE,
) -> Measurement:
    """Window metrics of a run from its parsed run.json and metrics records.

    ``gpu_type`` overrides run.json's ``gpu.type``; ``hardware`` supplies the peak FLOP/s
    (MFU is left out when the GPU type is not in it, e.g. ``cpu``); ``price`` the cost. ``window`` None: the window
    the run has (``default_window``).
    """
    shorter = window is None and default_window(records, metrics_origin) != DEFAULT_WINDOW
    first, last = window or default_window(records, metrics_origin)
    window_records = _window_records(records, first, last, metrics_origin)
    gpus = run.gpu.count
    notes: list[str] = []
    if shorter:
        notes.append(f"window steps {first}-{last}: the run has fewer than {DEFAULT_WINDOW[1] + 1} steps, so the "
                     f"window runs from step {first} to its last step (--window sets it)")
    step_times, tokens = _window_times_and_tokens(window_records, metrics_origin)
    window_time = math.fsum(step_times)
    throughput = m.tokens_per_s_per_gpu(tokens, window_time, gpus)
    mean, std, cv = m.step_time_stats(step_times)

    # rows are fixed-size, so a token count off rows x row tokens means a broken writer
    batch, row_tokens = run.global_batch, run.row_tokens
    if batch is not None and row_tokens is not None:
        expected = m.window_tokens(len(window_records), batch, row_tokens)
        if expected != tokens:
            notes.append(
                f"window tokens {tokens} differ from steps x global_batch x row_tokens = {expected}"
            )

    result = Measurement(
        window=(first, last),
        window_steps=len(window_records),
        window_tokens=tokens,
        window_time_s=window_time,
        gpu_type=gpu_type or run.gpu.type,
        gpus=gpus,
        tokens_per_s_per_gpu=throughput,
        step_time_mean_s=mean,
        step_time_std_s=std,
        step_time_cv=cv,
        notes=notes,
    )
    _add_flops(result, run, window_records, gpu_type, hardware, run_origin, metrics_origin)
    if price is not None:
        result.usd_per_gpu_hour = price.usd_per_gpu_hour
        result.price_source = price.source
        result.usd_per_million_tokens = usd_per_million_tokens(price.usd_per_gpu_hour, throughput)

    all_times = [require_number(record, "step_time_s", metrics_origin) for record in records]
    result.steps_recorded = len(records)
    result.total_step_time_s = math.fsum(all_times)
    result.gpu_hours = m.gpu_hours(gpus, result.total_step_time_s)
    planned = run.steps
    if planned is not None and planned != len(records):
        notes.append(f"run.json plans {planned} steps but metrics record {len(records)}: GPU-hours cover those recorded")

    result.peak_memory_gib = _peak(records, "peak_memory_gib", metrics_origin)
    result.peak_reserved_gib = _peak(records, "peak_reserved_gib", metrics_origin)
    return result


# a step slower than a year is no measurement: refused with its line rather than overflowing the sums
MAX_STEP_SECONDS = 365 * 24 * 3600.0


def _window_records(records: list[StepRecord], first: int, last: int, origin: str) -> list[StepRecord]:
    """The records of steps ``first`` to ``last``, every one of them present."""
    if first < 0 or last < first:
        raise ValueError(f"window {first} {last}: need 0 <= first <= last")
    by_step = {record.step: record for record in records}
    if by_step and last > max(by_step):  # before listing the missing steps: a window of 10**18 steps never ends
        raise ValueError(f"{origin}: window {first}-{last} goes past the last recorded step {max(by_step)}; choose "
                         "the steps with --window FIRST LAST")
    wanted = range(first, last + 1)
    missing = [step for step in wanted if step not in by_step]
    if missing:
        shown = ", ".join(str(s) for s in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ValueError(
            f"{origin}: window {first}-{last} is incomplete: missing step(s) {shown}; choose the steps "
            "with --window FIRST LAST"
        )
    return [by_step[step] for step in wanted]


def _window_times_and_tokens(window_records: list[StepRecord], origin: str) -> tuple[list[float], int]:
    """Each window step's time (positive, finite) and the window's token count (whole, not negative)."""
    step_times = []
    for record in window_records:
        seconds = require_number(record, "step_time_s", origin)
        if not 0 < seconds <= MAX_STEP_SECONDS:  # nan and inf too; a sum of 1e308s overflows
            raise ValueError(f"{origin}:{record.line}: step {record.step}: step_time_s must be positive and at most "
                             f"{MAX_STEP_SECONDS:g} s, got {seconds}")
        step_times.append(seconds)
    tokens = 0
    for record in window_records:
        value = require_number(record, "tokens", origin)
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"{origin}:{record.line}: step {record.step}: bad 'tokens' {value}")
        tokens += int(value)
    return step_times, tokens


def _add_flops(result: Measurement, run: RunInfo, window_records: list[StepRecord], gpu_type: str | None,
               hardware: HardwareTable | None, run_origin: str, metrics_origin: str) -> None:
    """MFU and model TFLOP/s where the run names its active parameters and the hardware table knows its GPU (an
    unknown GPU the user named is an error; one from run.json, a note)."""
    notes, model = result.notes, run.model
    if model.active_params is not None:
        result.active_params = model.active_params
    else:
        notes.append(f"{run_origin} has no model.active_params: MFU and model TFLOP/s left out")

    gpu_spec = None
    if hardware is not None:
        try:
            gpu_spec = hardware.gpu(result.gpu_type)
        except ValueError:
            if gpu_type is not None:
                raise  # the user named it explicitly: an unknown name is an error, not a note
            notes.append(f"GPU type {result.gpu_type!r} is not in the hardware table: MFU left out")
    if gpu_spec is not None:
        result.peak_flops_per_gpu = gpu_spec.peak_bf16_dense_flops
        if result.active_params is not None:
            result.mfu = m.mfu(result.active_params, result.tokens_per_s_per_gpu, gpu_spec.peak_bf16_dense_flops)

    if result.active_params is not None:
        result.model_tflops_per_gpu = _model_tflops(
            result.active_params, result.window_tokens, result.window_time_s, result.gpus, model, window_records,
            notes, run_origin=run_origin, metrics_origin=metrics_origin,
        )


def _peak(records: list[StepRecord], key: str, origin: str) -> float | None:
    """The largest of a per-step memory field over the records that have it (None: none has)."""
    present = [v for r in records if (v := require_number(r, key, origin, allow_null=True)) is not None]
    return max(present) if present else None


def _model_tflops(
    active: int,
    tokens: int,
    window_time: float,
    gpus: int,
    model: RunModelInfo,
    window_records: list[StepRecord],
    notes: list[str],
    *,
    run_origin: str,
    metrics_origin: str,
) -> float | None:
    dims = {key: getattr(model, key) for key in ("num_layers", "num_attention_heads", "head_dim")}
    absent = [key for key, value in dims.items() if value is None]
    if absent:
        notes.append(f"{run_origin} lacks model.{', model.'.join(absent)}: model TFLOP/s left out")
        return None
    sum_sq = 0.0
    for record in window_records:
        value = require_number(record, "sum_doc_len_sq", metrics_origin, allow_null=True)
        if value is None:
            notes.append(
                f"{metrics_origin}:{record.line}: step {record.step} has no sum_doc_len_sq: model TFLOP/s left out"
            )
            return None
        sum_sq += value
    flops = m.model_flops(
        active, tokens,
        num_layers=dims["num_layers"], num_heads=dims["num_attention_heads"],
        head_dim=dims["head_dim"], sum_doc_len_sq=sum_sq,
    )
    return flops / window_time / gpus / 1e12


def measure_run_dir(
    run_dir: str | os.PathLike,
    *,
    window: tuple[int, int] | None = None,
    gpu_type: str | None = None,
    usd_per_gpu_hour: float | None = None,
    instance: str | None = None,
    hardware_files: list[str | os.PathLike] | None = None,
) -> Measurement:
    """Read ``run_dir`` and compute its metrics; prices and peaks come from the hardware table."""
    run_dir = Path(run_dir)
    run = read_run_info(run_dir)
    metrics_path = run_dir / METRICS_FILE
    records = read_metrics(metrics_path)
    hardware = load_hardware(hardware_files)
    if gpu_type is not None and is_cpu(run.gpu.type) and not is_cpu(gpu_type):
        raise ValueError(f"--gpu {gpu_type}: {run_dir / RUN_FILE} records a CPU run (gpu.type {run.gpu.type}); its "
                         f"step times are not a {gpu_type}'s, so neither its MFU nor its price would be; measure it "
                         "without --gpu")
    gpu_name = gpu_type or run.gpu.type
    price = resolve_price(hardware, gpu_name, usd_per_gpu_hour=usd_per_gpu_hour, instance=instance)
    if instance is not None and is_cpu(gpu_name) and hardware.instance(instance).gpu is not None:
        spec = hardware.instance(instance)
        raise ValueError(f"--instance {spec.name}: its price is for a {spec.gpu} GPU-hour, but {run_dir / RUN_FILE} "
                         "records a CPU run (gpu.type cpu); give your machine's rate with --usd-per-gpu-hour, or "
                         "leave the price out")
    return compute_metrics(
        run, records, window=window, gpu_type=gpu_type, hardware=hardware, price=price,
        run_origin=str(run_dir / RUN_FILE), metrics_origin=str(metrics_path),
    )
