"""Qwen3-MoE state-dict adapter: Hugging Face names (one tensor per expert) <-> native names (grouped experts).

Pure tensor bookkeeping, no file I/O. HF stores ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` of shape
(out, in); native stacks them into ``...mlp.experts.{gate,up,down}_proj`` of shape (E, out, in).
"""

from __future__ import annotations

import re

import torch

from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig

_HF_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_NATIVE_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


def native_key(hf_key: str) -> tuple[str, int | None]:
    """Native parameter name of an HF tensor, and its expert index when it is one expert's slice."""
    match = _HF_EXPERT.match(hf_key)
    if match:
        return f"{match.group(1)}.{match.group(3)}", int(match.group(2))
    return hf_key, None


def hf_keys(native_name: str, num_experts: int) -> list[str]:
    """The HF tensor names that make up one native parameter (E names for a grouped expert tensor)."""
    match = _NATIVE_EXPERT.match(native_name)
    if match:
        return [f"{match.group(1)}.{e}.{match.group(2)}.weight" for e in range(num_experts)]
    return [native_name]


def to_hf(native_name: str, tensor: torch.Tensor, num_experts: int) -> list[tuple[str, torch.Tensor]]:
    """Split one native tensor into its HF tensors (contiguous copies, ready for safetensors)."""
    names = hf_keys(native_name, num_experts)
    if len(names) == 1:
        return [(names[0], tensor.contiguous())]
    if tensor.shape[0] != num_experts:
        raise ValueError(f"{native_name}: expected {num_experts} experts in dim 0, got shape {tuple(tensor.shape)}")
    return [(name, tensor[e].contiguous()) for e, name in enumerate(names)]


def expected_hf_shapes(config: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a checkpoint for ``config`` with its shape."""
    from openrecipes.models.qwen3_moe.model import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        for hf_name, piece in to_hf(name, param, config.num_experts):
            shapes[hf_name] = tuple(piece.shape)
    return shapes
