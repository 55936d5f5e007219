"""The hardware table, the one home of GPU facts: peak FLOP/s, memory, links per GPU type, price per instance.

``openrecipes measure``, ``plan``, ``card new``, the card checks and the loop (GPU names) all read it. The defaults
ship as ``hardware.yaml`` beside this module; a user file given with ``--hardware`` is merged over them entry by
entry (an entry of the same name replaces the default one whole, new names are added).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    # the most bf16 FLOP/s one CPU training process may reach: a bound for the card checks, never an MFU denominator
    cpu_peak_bf16_dense_flops: float | None = None

    def gpu(self, name: str) -> GpuSpec:
        # GPU names are matched without regard to case: "h200" and "H200" are the same part
        for key, spec in self.gpus.items():
            if key.lower() == name.lower():
                return spec
        close = difflib.get_close_matches(name.lower(), [key.lower() for key in self.gpus], n=1, cutoff=0.5)
        hint = next((f"did you mean {key}? " for key in self.gpus if close and key.lower() == close[0]), "")
        raise ValueError(
            f"unknown GPU type {name!r}; {hint}known: {', '.join(sorted(self.gpus))} "
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
    unknown = set(data) - {"gpus", "instances", "cpu"}
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
    return HardwareTable(gpus=gpus, instances=instances, cpu_peak_bf16_dense_flops=_parse_cpu(data.get("cpu"), origin))


def _parse_cpu(body: Any, origin: str) -> float | None:
    if body is None:
        return None
    where = f"{origin}: cpu"
    if not isinstance(body, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = set(body) - {"peak_bf16_dense_flops", "source"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if "peak_bf16_dense_flops" not in body:
        raise ValueError(f"{where}.peak_bf16_dense_flops: missing")
    _optional_str(body.get("source"), f"{where}.source")
    return _positive_number(body["peak_bf16_dense_flops"], f"{where}.peak_bf16_dense_flops")


def read_hardware_file(path: str | os.PathLike) -> HardwareTable:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"hardware file {path} not found")
    from openrecipes.config.safe_yaml import load_plain_yaml_file

    return parse_hardware(load_plain_yaml_file(path)[0], str(path))


def merge_hardware(base: HardwareTable, extra: HardwareTable) -> HardwareTable:
    return HardwareTable(
        gpus={**base.gpus, **extra.gpus}, instances={**base.instances, **extra.instances},
        cpu_peak_bf16_dense_flops=extra.cpu_peak_bf16_dense_flops or base.cpu_peak_bf16_dense_flops,
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


@dataclass(frozen=True, kw_only=True)
class Price:
    usd_per_gpu_hour: float
    source: str  # "--usd-per-gpu-hour", "instance NAME" or "default instance NAME of GPU"


def resolve_price(
    hardware: HardwareTable,
    gpu_type: str,
    *,
    usd_per_gpu_hour: float | None = None,
    instance: str | None = None,
) -> Price | None:
    """The price to use: an explicit one, else a named instance, else the GPU's default instance (None: no price)."""
    if usd_per_gpu_hour is not None and instance is not None:
        raise ValueError("give either --usd-per-gpu-hour or --instance, not both")
    if usd_per_gpu_hour is not None:
        if not math.isfinite(usd_per_gpu_hour) or usd_per_gpu_hour <= 0:
            raise ValueError(f"--usd-per-gpu-hour must be positive, got {usd_per_gpu_hour}")
        return Price(usd_per_gpu_hour=usd_per_gpu_hour, source="--usd-per-gpu-hour")
    if instance is not None:
        spec = hardware.instance(instance)
        return Price(usd_per_gpu_hour=spec.usd_per_gpu_hour, source=f"instance {spec.name}")
    try:
        gpu = hardware.gpu(gpu_type)
    except ValueError:
        return None
    if gpu.default_instance is None:
        return None
    spec = hardware.instance(gpu.default_instance)
    return Price(usd_per_gpu_hour=spec.usd_per_gpu_hour, source=f"default instance {spec.name} of {gpu.name}")


def usd_per_million_tokens(usd_per_gpu_hour: float, tokens_per_second_per_gpu: float) -> float:
    """$ / 1M tokens = USD per GPU-hour / (tokens/s/GPU x 3600) x 1e6 (measure and plan both price this way)."""
    if tokens_per_second_per_gpu <= 0:
        raise ValueError(f"tokens/s/GPU must be positive, got {tokens_per_second_per_gpu}")
    return usd_per_gpu_hour / (tokens_per_second_per_gpu * 3600.0) * 1e6


def known_gpu_name(device_name: str) -> str:
    """The table's name for a device name such as 'NVIDIA H200' (longest match first: GB200 before B200), else the
    device name itself."""
    names = sorted(read_hardware_file(DEFAULT_HARDWARE_FILE).gpus, key=len, reverse=True)
    upper = device_name.upper()
    return next((name for name in names if name.upper() in upper), device_name)


CPU_TYPE = "cpu"  # the gpu.type run.json records for a run on CPU (train/loop.py)


def is_cpu(gpu_type: str) -> bool:
    """Whether a recorded or given device type names the CPU (no GPU model: no peak, no GPU price)."""
    return gpu_type.strip().lower() == CPU_TYPE


# The one spelling of the GPU on every verb: `--gpu TYPE` where only the type is asked, `--gpus COUNTxTYPE` where the
# count is too (plan, tune). Both are read here; the type is checked against the hardware table where it is used.
GPU_FLAG = "--gpu"
GPUS_FLAG = "--gpus"


# The most GPUs a count may name: above the largest single training jobs published (tens of thousands of GPUs), and
# few enough that the planner's walk over the count's divisors and their layouts ends within a second
MAX_GPU_COUNT = 65_536


def parse_gpus(text: str, flag: str = GPUS_FLAG) -> tuple[int, str]:
    """``"128xH200"`` -> (128, "H200"); the type is as written (the table matches it without regard to case)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*([A-Za-z0-9_.-]+)\s*", text)
    if not match or int(match.group(1)[:20]) < 1:
        raise ValueError(f"{flag}: expected COUNTxTYPE such as 8xH200, got {text[:80]!r}")
    digits = match.group(1).lstrip("0")
    if len(digits) > len(str(MAX_GPU_COUNT)) or int(digits) > MAX_GPU_COUNT:
        raise ValueError(f"{flag}: {digits[:20]}{'...' if len(digits) > 20 else ''} GPUs is over the limit of "
                         f"{MAX_GPU_COUNT:,} (MAX_GPU_COUNT) that a plan or a tuning run considers")
    return int(digits), match.group(2)


def add_gpu_option(parser: argparse.ArgumentParser, *, help: str, aliases: tuple[str, ...] = (), **kwargs: Any) -> None:
    """``--gpu TYPE`` on a verb; ``aliases`` are older spellings still accepted (help says they are deprecated)."""
    if aliases:
        help += f" ({', '.join(aliases)}: deprecated spelling of {GPU_FLAG})"
    parser.add_argument(GPU_FLAG, *aliases, dest="gpu", metavar="TYPE", help=help, **kwargs)


def add_gpus_option(parser: argparse.ArgumentParser, *, help: str, **kwargs: Any) -> None:
    """``--gpus COUNTxTYPE`` on a verb (the count and the type, parsed by ``parse_gpus``)."""
    parser.add_argument(GPUS_FLAG, dest="gpus", metavar="COUNTxTYPE", help=help, **kwargs)
