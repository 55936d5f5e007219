"""Activation recompute, applied from outside the model by wrapping module forwards.

- full, uniform, num_layers 1: every decoder layer keeps only its input; everything inside is recomputed.
- full, block, num_layers N: the first N decoder layers are recomputed whole, the rest keep activations.
- selective: each layer's attention block (projections, norms, RoPE and the attention kernel) is recomputed;
  the MoE block keeps its activations.
Wrapping the instance's ``forward`` keeps parameter names unchanged (no wrapper modules in state dicts).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _recompute_forward(module: nn.Module) -> None:
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(layers: list[nn.Module], *, granularity: str, method: str = "uniform", num_layers: int = 1) -> int:
    """Wrap the chosen modules of ``layers`` (decoder layers, in order). Returns how many were wrapped."""
    if granularity == "none":
        return 0
    if granularity == "selective":
        for layer in layers:
            _recompute_forward(layer.self_attn)
        return len(layers)
    if granularity != "full":
        raise ValueError(f"recompute.granularity: unknown value {granularity!r}")
    chosen = layers if method == "uniform" else layers[:num_layers]
    for layer in chosen:
        _recompute_forward(layer)
    return len(chosen)
