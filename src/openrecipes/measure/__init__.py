"""Throughput, utilisation and cost of a training run (``openrecipes measure``).

Pure functions live in :mod:`openrecipes.measure.metrics`; reading a run directory and
putting the numbers together in :mod:`openrecipes.measure.compute`.
"""

from openrecipes.measure.compute import Measurement, compute_metrics, measure_run_dir, resolve_price
from openrecipes.config.hardware import HardwareTable, load_hardware, usd_per_million_tokens
from openrecipes.measure.metrics import (
    attention_flops,
    gpu_hours,
    mfu,
    model_flops,
    step_time_stats,
    tokens_per_s_per_gpu,
    window_tokens,
)

__all__ = [
    "HardwareTable",
    "Measurement",
    "attention_flops",
    "compute_metrics",
    "gpu_hours",
    "load_hardware",
    "measure_run_dir",
    "mfu",
    "model_flops",
    "resolve_price",
    "step_time_stats",
    "tokens_per_s_per_gpu",
    "usd_per_million_tokens",
    "window_tokens",
]
