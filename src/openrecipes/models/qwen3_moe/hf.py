"""Qwen3-MoE state-dict adapter: HF names (one tensor per expert) <-> native names (grouped experts)."""

from __future__ import annotations

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig

KEYS = ExpertKeyMap("model.layers")
native_key = KEYS.native_key
hf_keys = KEYS.hf_keys


def to_hf(native_name: str, tensor: torch.Tensor, config: Qwen3MoeConfig) -> list[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(native_name, tensor, config.num_experts)


def expected_hf_shapes(config: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    from openrecipes.models.qwen3_moe.model import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return KEYS.expected_hf_shapes(Qwen3MoeForCausalLM(config), config.num_experts)
