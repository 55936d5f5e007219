"""The gated MLP of dense decoder layers and shared experts, as transformers' families write it (SwiGLU-style)."""

from __future__ import annotations

import torch
from torch import nn

from openrecipes.models.common.activations import ACTIVATIONS


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden_size: int, ffn_size: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))
