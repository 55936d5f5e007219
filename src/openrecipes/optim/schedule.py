"""Learning rate: linear warm-up over a fraction of the steps, then cosine decay to a minimum."""

from __future__ import annotations

import math


def lr_at(step: int, *, total_steps: int, lr: float, min_lr: float, warmup_fraction: float,
          decay: str = "cosine") -> float:
    """Learning rate of optimizer step ``step`` (0-based). Warm-up reaches ``lr`` at the end of its last step."""
    warmup_steps = int(round(warmup_fraction * total_steps))
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    raise ValueError(f"optimizer.decay: unknown decay style {decay!r}; expected cosine, linear or constant")
