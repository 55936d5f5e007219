"""Adapters with a visible effect, for the LoRA tests against peft: ours on our model, or peft's on transformers'."""

from __future__ import annotations

from pathlib import Path

import torch

from openrecipes.checkpoint.hf import from_hf
from openrecipes.models.common.lora import LoraSpec, apply_lora


def randomize(model: torch.nn.Module, marker: str, seed: int) -> None:
    """Every parameter whose name holds ``marker`` drawn at 0.2 scale (B starts at zero: an adapter must change the
    output for a comparison to mean anything)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if marker in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def ours_with_adapters(base: Path, spec: LoraSpec, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Our model read from the HF directory ``base``, with ``spec``'s adapters, every B random."""
    model = from_hf(base, dtype=dtype)
    apply_lora(model, spec)
    randomize(model, "lora_B", seed=5)
    return model.eval()
