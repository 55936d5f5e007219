"""Hugging Face checkpoints store one tensor per expert (``...mlp.experts.{e}.{gate,up,down}_proj.weight``, shape
(out, in)); the native models stack them (``...mlp.experts.{gate,up,down}_proj``, shape (E, out, in)). This maps
names and tensors both ways for any decoder prefix; pure bookkeeping, no file I/O."""

from __future__ import annotations

import re

import torch
from torch import nn


class ExpertKeyMap:
    def __init__(self, layers_prefix: str) -> None:
        """``layers_prefix``: where the decoder layers live, e.g. ``model.layers``."""
        base = re.escape(layers_prefix) + r"\.\d+\.mlp\.experts"
        self._hf_expert = re.compile(rf"^({base})\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
        self._native_expert = re.compile(rf"^({base})\.(gate_proj|up_proj|down_proj)$")

    def native_key(self, hf_key: str) -> tuple[str, int | None]:
        """Native parameter name of an HF tensor, and its expert index when it is one expert's slice."""
        match = self._hf_expert.match(hf_key)
        if match:
            return f"{match.group(1)}.{match.group(3)}", int(match.group(2))
        return hf_key, None

    def hf_keys(self, native_name: str, num_experts: int) -> list[str]:
        """The HF tensor names that make up one native parameter (E names for a grouped expert tensor)."""
        match = self._native_expert.match(native_name)
        if match:
            return [f"{match.group(1)}.{e}.{match.group(2)}.weight" for e in range(num_experts)]
        return [native_name]

    def to_hf(self, native_name: str, tensor: torch.Tensor, num_experts: int) -> list[tuple[str, torch.Tensor]]:
        """Split one native tensor into its HF tensors (contiguous copies, ready for safetensors; dtype kept)."""
        names = self.hf_keys(native_name, num_experts)
        if len(names) == 1:
            return [(names[0], tensor.contiguous())]
        if tensor.shape[0] != num_experts:
            raise ValueError(f"{native_name}: expected {num_experts} experts in dim 0, got shape {tuple(tensor.shape)}")
        return [(name, tensor[e].contiguous()) for e, name in enumerate(names)]

    def expected_hf_shapes(self, model: nn.Module, num_experts: int) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name of a checkpoint of ``model`` (build it on the meta device) with its shape."""
        return {hf_name: tuple(piece.shape) for name, param in model.named_parameters()
                for hf_name, piece in self.to_hf(name, param, num_experts)}
