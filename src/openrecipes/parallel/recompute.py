"""Activation recompute, applied from outside the model with torch's composable ``checkpoint``: hooks on the
module, so its forward and its parameter names stay as they are (no wrapper modules in state dicts).

What each decoder layer recomputes (``granularity``):

- full: everything; the layer keeps only its input.
- selective: the attention block (projections, norms, RoPE and the attention kernel); the MoE block keeps its
  activations.
- attention_core: the attention kernel alone (softmax(QKᵀ)V over the documents); the projections keep theirs.
- experts: the routed experts (their SwiGLU and projections); attention and the router keep theirs.

Which layers (``method``): ``uniform`` every decoder layer; ``block`` the first ``num_layers`` of them (of this
pipeline stage), the rest keep every activation.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import checkpoint as checkpoint_function

from openrecipes.models.common.attention import attention

GRANULARITIES = ("none", "full", "selective", "attention_core", "experts")


class RecomputedAttentionCore:
    """An attention backend (a kernel name, or parallelism's callable) whose output is recomputed in the backward
    instead of keeping what the kernel saves (its softmax statistics, or the probabilities of the reference
    kernel); q, k and v stay saved by the projections that made them."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, documents, window):
        core = functools.partial(attention, scale=scale, documents=documents, window=window, backend=self.backend)
        return checkpoint_function(core, q, k, v, use_reentrant=False)


def apply_recompute(layers: list[nn.Module], *, granularity: str, method: str = "uniform", num_layers: int = 1,
                    attention_of: Callable[[nn.Module], nn.Module] | None = None,
                    experts_of: Callable[[nn.Module], nn.Module] | None = None) -> list[nn.Module]:
    """Recompute part of the chosen decoder ``layers`` (see the module docstring); ``attention_of`` and
    ``experts_of`` find a layer's attention module and routed experts. Returns the modules whose whole forward is
    recomputed (attention_core recomputes a function inside the attention module: none)."""
    if granularity == "none":
        return []
    if granularity not in GRANULARITIES:
        raise ValueError(f"recompute.granularity: unknown value {granularity!r}")
    if method not in ("uniform", "block"):
        raise ValueError(f"recompute.method: unknown value {method!r}")
    chosen = layers if method == "uniform" else layers[:num_layers]
    if granularity == "attention_core":
        for layer in chosen:
            module = attention_of(layer)
            module.backend = RecomputedAttentionCore(module.backend)
        return []
    part = {"full": lambda layer: layer, "selective": attention_of, "experts": experts_of}[granularity]
    recomputed = [part(layer) for layer in chosen]
    for module in recomputed:
        checkpoint(module)
    return recomputed
