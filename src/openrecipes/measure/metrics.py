"""Throughput, utilisation and cost of a training run, as pure functions.

Definitions (docs/measure.md has them in full):

* tokens/s/GPU  = window tokens / window time / GPUs; window time = sum of the window's step times
* step-time CV  = population standard deviation (ddof = 0) / mean of the window's step times
* MFU           = 6 · N · tokens/s/GPU / peak bf16 dense FLOP/s of one GPU
* model FLOPs   = 6 · N · tokens + 6 · layers · heads · head_dim · Σ sᵢ²  (attention, causal halving)
* $ / 1M tokens = USD per GPU-hour / (tokens/s/GPU · 3600) · 1e6 (config/hardware.py, beside the prices)
* GPU-hours     = GPUs · (sum of every recorded step time) / 3600, so startup is excluded
"""

from __future__ import annotations

import math
from typing import Sequence


def window_tokens(steps: int, global_batch: int, row_tokens: int) -> int:
    """Tokens in a window of fixed-size rows: steps × rows per step × tokens per row."""
    return steps * global_batch * row_tokens


def tokens_per_s_per_gpu(tokens: float, seconds: float, gpus: int) -> float:
    if seconds <= 0:
        raise ValueError(f"window time must be positive, got {seconds} s")
    if gpus < 1:
        raise ValueError(f"GPU count must be at least 1, got {gpus}")
    return tokens / seconds / gpus


def step_time_stats(step_times: Sequence[float]) -> tuple[float, float, float]:
    """(mean, population std, CV = std / mean) of step times.

    The population std (ddof = 0) treats the window as the whole set being described,
    not a sample of a larger one; with 15 steps it is ~3.4 % below the sample std.
    """
    if not step_times:
        raise ValueError("no step times to summarise")
    count = len(step_times)
    mean = math.fsum(step_times) / count
    variance = math.fsum((t - mean) ** 2 for t in step_times) / count
    std = math.sqrt(variance)
    return mean, std, std / mean


def mfu(active_params: float, tokens_per_second_per_gpu: float, peak_flops_per_gpu: float) -> float:
    """Model FLOPs utilisation with 6 FLOPs per active parameter per token (2 forward, 4 backward)."""
    if peak_flops_per_gpu <= 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak_flops_per_gpu}")
    return 6.0 * active_params * tokens_per_second_per_gpu / peak_flops_per_gpu


def attention_flops(num_layers: int, num_heads: int, head_dim: int, sum_doc_len_sq: float) -> float:
    """Forward + backward FLOPs of causal attention scores and context over packed documents.

    Per layer, the forward pass runs two matmuls (Q·Kᵀ and P·V) of 2 FLOPs per multiply-add
    over heads × head_dim × sᵢ² pairs per document, halved because causal masking keeps
    only the lower triangle: 2 · 2 · heads · head_dim · Σ sᵢ² / 2. Backward costs twice the
    forward, hence × 3 in all: 6 · layers · heads · head_dim · Σ sᵢ².
    """
    return 6.0 * num_layers * num_heads * head_dim * sum_doc_len_sq


def model_flops(
    active_params: float,
    tokens: float,
    *,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    sum_doc_len_sq: float,
) -> float:
    """Total training FLOPs: dense 6·N per token plus causal attention (see ``attention_flops``)."""
    return 6.0 * active_params * tokens + attention_flops(num_layers, num_heads, head_dim, sum_doc_len_sq)


def gpu_hours(gpus: int, seconds: float) -> float:
    return gpus * seconds / 3600.0
