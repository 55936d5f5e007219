"""Activation recompute, applied from outside the model with torch's composable ``checkpoint``: hooks on the
module, so its forward and its parameter names stay as they are (no wrapper modules in state dicts).

What each decoder layer recomputes (``granularity``):

- full: everything; the layer keeps only its input.
- full_keep_attention: everything but the attention kernel; the layer keeps its input and the kernel keeps its
  inputs, output and softmax statistics. At long rows the kernel is most of a layer's forward, and what it keeps is
  a few hidden widths per token.
- selective: the attention block (projections, norms, RoPE and the attention kernel); the MoE block keeps its
  activations.
- attention_core: the attention kernel alone (softmax(QKᵀ)V over the documents); the projections keep theirs.
- experts: the routed experts (their SwiGLU and projections); attention and the router keep theirs.

Which layers (``method``): ``uniform`` every decoder layer; ``block`` the first ``num_layers`` of them (of this
pipeline stage), the rest keep every activation.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import checkpoint as checkpoint_function

from openrecipes.config.recompute_names import RECOMPUTE_GRANULARITIES, WHOLE_LAYER_GRANULARITIES
from openrecipes.models.common.attention import attention


class RecomputedAttentionCore:
    """An attention backend (a kernel name, or parallelism's callable) whose output is recomputed in the backward
    instead of keeping what the kernel saves (its softmax statistics, or the probabilities of the reference
    kernel); q, k and v stay saved by the projections that made them."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, documents, window):
        core = functools.partial(attention, scale=scale, documents=documents, window=window, backend=self.backend)
        return checkpoint_function(core, q, k, v, use_reentrant=False)


def _in_place(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class KeptAttentionCore:
    """An attention backend whose kernel runs once under a recomputed layer. In the forward the kernel saves what
    its backward reads as it would without recompute (saved-tensor hooks of its own take precedence over the layer
    checkpoint's), and its output is kept; when the backward recomputes the layer, the kept output stands in for the
    kernel. Outputs are taken back in the order they were made, which is the order in which any schedule here
    runs the backwards of one layer's microbatches (gradient accumulation, 1F1B)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.kept: collections.deque[torch.Tensor] = collections.deque()

    @torch._dynamo.disable  # a graph break: the kernel is already one kernel, and the choice is made at run time
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, documents, window):
        if torch._C._current_graph_task_id() != -1:  # inside a backward: the layer checkpoint's recompute
            if not self.kept:
                raise RuntimeError("recompute.granularity full_keep_attention: the backward recomputes a layer "
                                   "whose attention output was not kept")
            # requiring grad as the kernel's output did, so the ops after it save what they saved the first time
            return self.kept.popleft().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(_in_place, _in_place):
            out = attention(q, k, v, scale=scale, documents=documents, window=window, backend=self.backend)
        if out.requires_grad:
            self.kept.append(out.detach())
        return out


def apply_recompute(layers: list[nn.Module], *, granularity: str, method: str = "uniform", num_layers: int = 1,
                    attention_of: Callable[[nn.Module], nn.Module] | None = None,
                    experts_of: Callable[[nn.Module], nn.Module] | None = None) -> list[nn.Module]:
    """Recompute part of the chosen decoder ``layers`` (see the module docstring); ``attention_of`` and
    ``experts_of`` find a layer's attention module and routed experts. Returns the modules whose whole forward is
    recomputed (attention_core recomputes a function inside the attention module: none)."""
    if granularity == "none":
        return []
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute.granularity: unknown value {granularity!r}")
    if method not in ("uniform", "block"):
        raise ValueError(f"recompute.method: unknown value {method!r}")
    chosen = layers if method == "uniform" else layers[:num_layers]
    if granularity == "attention_core":
        for layer in chosen:
            module = attention_of(layer)
            module.backend = RecomputedAttentionCore(module.backend)
        return []
    if granularity == "full_keep_attention":
        for layer in chosen:
            module = attention_of(layer)
            module.backend = KeptAttentionCore(module.backend)
    part = (lambda layer: layer) if granularity in WHOLE_LAYER_GRANULARITIES else \
        {"selective": attention_of, "experts": experts_of}[granularity]
    recomputed = [part(layer) for layer in chosen]
    for module in recomputed:
        checkpoint(module)
    return recomputed
