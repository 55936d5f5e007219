"""The decoder stack every text family runs: embedding, decoder layers (all, or a pipeline chunk), final norm, LM
head. A family's model holds ``model.embed_tokens``, ``model.layers`` (a ModuleDict keyed by global layer index),
``model.norm`` and ``lm_head``, any of which a pipeline stage may have dropped (None), and its layers take
``(hidden, angles, documents)``; the family computes the RoPE angles (its rotated width, base and scaling).
"""

from __future__ import annotations

import torch
from torch import nn

from openrecipes.models.common.attention import Documents


def positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The given position ids, or 0..T-1 on every row."""
    if position_ids is not None:
        return position_ids
    rows, tokens = input_ids.shape[:2]
    return torch.arange(tokens, device=input_ids.device).expand(rows, tokens)


def decoder_stack(model: nn.Module, input_ids: torch.Tensor, angles_BTF: torch.Tensor,
                  documents: Documents | None, layers: range | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, hidden). ``layers``: run only these decoder layers (global indices; an interleaved pipeline chunk).
    The embedding runs before layer 0, the final norm after the last layer and the head after it, so a chunk in the
    middle takes and gives hidden states even where the module holds the embedding or the head for another chunk.
    ``hidden`` is the last hidden state (after the final norm where it ran); ``output`` the head's logits after the
    last layer, else ``hidden``."""
    backbone = model.model
    first = layers is None or layers.start == 0
    last = layers is None or layers.stop == model.config.num_hidden_layers
    h = backbone.embed_tokens(input_ids) if backbone.embed_tokens is not None and first else input_ids
    chosen = backbone.layers.values() if layers is None else [backbone.layers[str(i)] for i in layers]
    for layer in chosen:
        h = layer(h, angles_BTF, documents)
    if backbone.norm is not None and last:
        h = backbone.norm(h)
    return (model.lm_head(h) if model.lm_head is not None and last else h), h
