"""Activation recompute, applied from outside the model with torch's composable ``checkpoint``: hooks on the
module, so its forward and its parameter names stay as they are (no wrapper modules in state dicts).

- full, uniform, num_layers 1: every decoder layer keeps only its input; everything inside is recomputed.
- full, block, num_layers N: the first N decoder layers are recomputed whole, the rest keep activations.
- selective: each layer's attention block (projections, norms, RoPE and the attention kernel) is recomputed;
  the MoE block keeps its activations (the caller passes the attention modules).
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def apply_recompute(modules: list[nn.Module], *, granularity: str, method: str = "uniform",
                    num_layers: int = 1) -> list[nn.Module]:
    """Recompute the chosen ``modules`` (decoder layers, or their attention blocks for ``selective``), in order.
    Returns the chosen modules."""
    if granularity == "none":
        return []
    if granularity not in ("selective", "full"):
        raise ValueError(f"recompute.granularity: unknown value {granularity!r}")
    chosen = modules if granularity == "selective" or method == "uniform" else modules[:num_layers]
    for module in chosen:
        checkpoint(module)
    return list(chosen)
