"""The planner's view of the hardware: a GPU of the hardware table (``openrecipes.config.hardware``) with the
efficiency and overhead data of ``planner.yaml`` (or a file given)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrecipes.config.hardware import LINK_AND_MEMORY_FIELDS, GpuSpec, load_hardware as load_hardware_table
from openrecipes.config.hardware import parse_hardware

DEFAULT_PLANNER_FILE = Path(__file__).with_name("planner.yaml")
GIB = 1024 ** 3  # bytes in a GiB, the unit the planner gives memory in (planner.yaml, the hardware table)


@dataclass(kw_only=True, frozen=True)
class Efficiency:
    dense_matmul: float
    expert_matmul: float
    attention: float
    comm: float
    hbm: float


@dataclass(kw_only=True, frozen=True)
class MemoryOverheads:
    allocator_overhead: float
    expandable_allocator_overhead: float
    cuda_context_gib: float
    fixed_overhead_gib: float
    comm_buffer_gib: float
    working_set_multiplier: float
    moe_token_imbalance: float


@dataclass(kw_only=True, frozen=True)
class EngineCalibration:
    """What this engine (``--engine openrecipes``) adds to the model, fitted to our own runs (docs/plan.md)."""
    tp_s_per_layer: float  # per layer and microbatch under tensor parallelism
    cp_s_per_layer: float  # per layer and microbatch under context parallelism
    cpu_adam_elements_per_s_per_rank: float  # the offloaded share of the optimizer
    # family -> GPU type -> factor on the planner's compute time, fitted to that family's measured runs on that GPU
    # (bench/predicted.py --fit); a family or GPU not listed: 1
    family_compute_scale: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def compute_scale(self, family: str, gpu: str) -> float:
        return self.family_compute_scale.get(family, {}).get(gpu, 1.0)


@dataclass(kw_only=True, frozen=True)
class Hardware:
    gpu: GpuSpec
    efficiency: Efficiency
    memory: MemoryOverheads
    cpu_adam_elements_per_s: float
    openrecipes_engine: EngineCalibration | None = None


def _section(raw: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{source}: missing mapping {key!r}")
    return value


def _positive_number(value: Any) -> bool:
    """A finite number above 0 (a bool is no number here, nan and inf are no setting)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _build(cls: type, values: dict[str, Any], where: str, **extra: Any) -> Any:
    names = set(cls.__dataclass_fields__) - {"name"} - set(extra)
    missing, unknown = names - set(values), set(values) - names
    if missing or unknown:
        raise ValueError(f"{where}: missing {sorted(missing)} / unknown {sorted(unknown)} fields")
    for key, value in values.items():
        if not _positive_number(value):
            raise ValueError(f"{where}.{key}: must be a positive number, got {value!r}")
    return cls(**values, **extra)


def _planner_gpu(gpu_type: str, extra_gpus: dict[str, Any] | None, source: str, memory_gib: float | None) -> GpuSpec:
    table = load_hardware_table()
    if extra_gpus:
        table = dataclasses.replace(table, gpus={**table.gpus, **parse_hardware({"gpus": extra_gpus}, source).gpus})
    try:
        gpu = table.gpu(gpu_type)
    except ValueError as error:
        raise ValueError(f"--gpus: {error}") from None
    if memory_gib is not None:
        if not math.isfinite(memory_gib) or memory_gib <= 0:
            raise ValueError(f"--gpu-memory-gib: must be a positive number, got {memory_gib}")
        gpu = dataclasses.replace(gpu, memory_gib=memory_gib)
    missing = [key for key in LINK_AND_MEMORY_FIELDS if getattr(gpu, key) is None]
    if missing:
        raise ValueError(f"--gpus: the hardware table has no {', '.join(missing)} for {gpu.name}, which the planner "
                         f"needs (add them with --hardware FILE under gpus.{gpu.name})")
    return gpu


def load_hardware(gpu_type: str, *, path: str | Path | None = None, memory_gib: float | None = None) -> Hardware:
    """The planner's record for ``gpu_type`` (case-insensitive); ``memory_gib`` overrides its memory. ``path`` is a
    planner file (efficiency, memory, cpu_optimizer, openrecipes_engine) that may also add or replace ``gpus``."""
    from openrecipes.config.safe_yaml import load_plain_yaml_file

    source = Path(path) if path else DEFAULT_PLANNER_FILE
    if not source.exists():
        raise FileNotFoundError(f"hardware file {source} not found")
    raw = load_plain_yaml_file(source)[0]
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a planner file is a mapping (gpus, efficiency, memory, cpu_optimizer), not a "
                         f"{type(raw).__name__}")
    gpu = _planner_gpu(gpu_type, raw.get("gpus"), str(source), memory_gib)
    cpu = _section(raw, "cpu_optimizer", str(source))
    rate = cpu.get("elements_per_s_per_rank")
    if not _positive_number(rate):
        raise ValueError(f"{source.name}: cpu_optimizer.elements_per_s_per_rank must be a positive number")
    return Hardware(
        gpu=gpu,
        efficiency=_build(Efficiency, _section(raw, "efficiency", str(source)), f"{source.name}: efficiency"),
        memory=_build(MemoryOverheads, _section(raw, "memory", str(source)), f"{source.name}: memory"),
        cpu_adam_elements_per_s=float(rate),
        openrecipes_engine=_engine_calibration(raw["openrecipes_engine"], f"{source.name}: openrecipes_engine")
        if "openrecipes_engine" in raw else None,
    )


def _engine_calibration(values: Any, where: str) -> EngineCalibration:
    """The ``openrecipes_engine`` block: its numbers, and the per-family compute scales (a mapping of mappings of
    positive numbers)."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a mapping")
    scales = values.get("family_compute_scale") or {}
    if not isinstance(scales, dict) or not all(isinstance(by_gpu, dict) for by_gpu in scales.values()):
        raise ValueError(f"{where}.family_compute_scale: expected family: {{GPU type: factor}}")
    for family, by_gpu in scales.items():
        for gpu, factor in by_gpu.items():
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0.1 <= factor <= 10:
                raise ValueError(f"{where}.family_compute_scale.{family}.{gpu}: must be a number from 0.1 to 10, "
                                 f"got {factor!r}")
    numbers = {k: v for k, v in values.items() if k != "family_compute_scale"}
    return _build(EngineCalibration, numbers, where, family_compute_scale={
        family: {gpu: float(f) for gpu, f in by_gpu.items()} for family, by_gpu in scales.items()})
