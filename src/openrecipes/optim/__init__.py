"""Optimizers: AdamW with FP32 masters, precision-aware Adam (bf16 params + int16 remainders), CPU offload,
learning-rate schedules."""

from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam, bytes_per_param
from openrecipes.optim.schedule import lr_at

__all__ = ["AdamConfig", "MixedPrecisionAdam", "bytes_per_param", "lr_at"]
