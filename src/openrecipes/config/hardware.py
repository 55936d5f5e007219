"""The hardware table, the one home of GPU facts: peak FLOP/s, memory, links per GPU type, price per instance.

``openrecipes measure``, ``plan``, ``card new``, the card checks and the loop (GPU names) all read it. The defaults
ship as ``hardware.yaml`` beside this module; a user file given with ``--hardware`` is merged over them entry by
entry (an entry of the same name replaces the default one whole, new names are added).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_HARDWARE_FILE = Path(__file__).with_name("hardware.yaml")


# what the planner needs beyond the peak; a GPU without them can be measured but not planned
LINK_AND_MEMORY_FIELDS = ("memory_gib", "hbm_tb_s", "nvlink_gb_s", "nvlink_domain", "network_gb_s", "pcie_gb_s")


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    name: str
    peak_bf16_dense_flops: float
    memory_gb: float | None = None       # as sold ("141 GB"): what a card states
    memory_gib: float | None = None      # as the device reports it (nvidia-smi MiB / 1024): what the planner fills
    hbm_tb_s: float | None = None
    nvlink_gb_s: float | None = None     # per GPU and direction
    nvlink_domain: int | None = None     # GPUs one NVLink domain joins
    network_gb_s: float | None = None    # scale-out per GPU and direction
    pcie_gb_s: float | None = None       # host link per direction
    default_instance: str | None = None
    source: str | None = None


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    name: str
    usd_per_gpu_hour: float
    gpu: str | None = None
    gpus_per_instance: int | None = None
    source: str | None = None


@dataclass(frozen=True, kw_only=True)
class HardwareTable:
    gpus: dict[str, GpuSpec] = field(default_factory=dict)
    instances: dict[str, InstanceSpec] = field(default_factory=dict)

    def gpu(self, name: str) -> GpuSpec:
        # GPU names are matched without regard to case: "h200" and "H200" are the same part
        for key, spec in self.gpus.items():
            if key.lower() == name.lower():
                return spec
        raise ValueError(
            f"unknown GPU type {name!r}; known: {', '.join(sorted(self.gpus))} "
            "(add it with --hardware FILE)"
        )

    def instance(self, name: str) -> InstanceSpec:
        if name in self.instances:
            return self.instances[name]
        raise ValueError(
            f"unknown instance {name!r}; known: {', '.join(sorted(self.instances))} "
            "(add it with --hardware FILE)"
        )


def _positive_number(value: Any, where: str) -> float:
    # YAML 1.1 reads 989.0e12 (no exponent sign) as a string; accept it rather than
    # make every user learn to write 989.0e+12
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{where}: expected a positive finite number, got {value!r}")
    return number


def _optional_str(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {value!r}")
    return value


def _parse_gpu(name: str, body: Any, where: str) -> GpuSpec:
    if not isinstance(body, dict):
        raise ValueError(f"{where}: expected a mapping")
    numbers = ("peak_bf16_dense_flops", "memory_gb", *LINK_AND_MEMORY_FIELDS)
    unknown = set(body) - {*numbers, "default_instance", "source"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if "peak_bf16_dense_flops" not in body:
        raise ValueError(f"{where}.peak_bf16_dense_flops: missing")
    values: dict[str, Any] = {key: _positive_number(body[key], f"{where}.{key}") for key in numbers if key in body}
    if "nvlink_domain" in values:
        if values["nvlink_domain"] != int(values["nvlink_domain"]):
            raise ValueError(f"{where}.nvlink_domain: expected a whole number of GPUs, got {body['nvlink_domain']!r}")
        values["nvlink_domain"] = int(values["nvlink_domain"])
    return GpuSpec(
        name=name, **values,
        default_instance=_optional_str(body.get("default_instance"), f"{where}.default_instance"),
        source=_optional_str(body.get("source"), f"{where}.source"),
    )


def _parse_instance(name: str, body: Any, where: str) -> InstanceSpec:
    if not isinstance(body, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = set(body) - {"usd_per_gpu_hour", "gpu", "gpus_per_instance", "source"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if "usd_per_gpu_hour" not in body:
        raise ValueError(f"{where}.usd_per_gpu_hour: missing")
    count = body.get("gpus_per_instance")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"{where}.gpus_per_instance: expected a positive integer, got {count!r}")
    return InstanceSpec(
        name=name,
        usd_per_gpu_hour=_positive_number(body["usd_per_gpu_hour"], f"{where}.usd_per_gpu_hour"),
        gpu=_optional_str(body.get("gpu"), f"{where}.gpu"),
        gpus_per_instance=count,
        source=_optional_str(body.get("source"), f"{where}.source"),
    )


def parse_hardware(data: Any, origin: str) -> HardwareTable:
    """Validate a parsed hardware mapping; ``origin`` names the file in error messages."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a mapping with 'gpus' and/or 'instances'")
    unknown = set(data) - {"gpus", "instances"}
    if unknown:
        raise ValueError(f"{origin}: unknown top-level key(s) {', '.join(sorted(unknown))}")
    gpus_raw = data.get("gpus") or {}
    instances_raw = data.get("instances") or {}
    for key, value in (("gpus", gpus_raw), ("instances", instances_raw)):
        if not isinstance(value, dict):
            raise ValueError(f"{origin}: {key}: expected a mapping of name -> entry")
    gpus = {
        str(name): _parse_gpu(str(name), body, f"{origin}: gpus.{name}")
        for name, body in gpus_raw.items()
    }
    instances = {
        str(name): _parse_instance(str(name), body, f"{origin}: instances.{name}")
        for name, body in instances_raw.items()
    }
    return HardwareTable(gpus=gpus, instances=instances)


def read_hardware_file(path: str | os.PathLike) -> HardwareTable:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"hardware file {path} not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    return parse_hardware(data, str(path))


def merge_hardware(base: HardwareTable, extra: HardwareTable) -> HardwareTable:
    return HardwareTable(
        gpus={**base.gpus, **extra.gpus}, instances={**base.instances, **extra.instances}
    )


def load_hardware(extra_files: list[str | os.PathLike] | None = None) -> HardwareTable:
    """The default table with each of ``extra_files`` merged over it, in order."""
    table = read_hardware_file(DEFAULT_HARDWARE_FILE)
    for path in extra_files or []:
        table = merge_hardware(table, read_hardware_file(path))
    # a default instance that names nothing would silently drop the price; refuse it
    for gpu in table.gpus.values():
        if gpu.default_instance is not None and gpu.default_instance not in table.instances:
            raise ValueError(
                f"gpus.{gpu.name}.default_instance names unknown instance {gpu.default_instance!r}"
            )
    return table


def known_gpu_name(device_name: str) -> str:
    """The table's name for a device name such as 'NVIDIA H200' (longest match first: GB200 before B200), else the
    device name itself."""
    names = sorted(read_hardware_file(DEFAULT_HARDWARE_FILE).gpus, key=len, reverse=True)
    upper = device_name.upper()
    return next((name for name in names if name.upper() in upper), device_name)
