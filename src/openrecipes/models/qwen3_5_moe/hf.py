"""Qwen3.5-MoE state-dict adapter: HF names <-> native names (grouped routed experts; MTP layers skipped).

Every name but the routed experts' is transformers' Qwen3_5MoeForCausalLM's own (``linear_attn.*``, ``self_attn.*``,
``mlp.shared_expert.*``, ``mlp.shared_expert_gate``). Experts are read in either layout of
``common/hf_experts.py`` and written fused (``gate_up_proj``, ``down_proj``), as transformers 5.x holds and saves
them. The published checkpoints' multi-token-prediction tensors (``mtp.*``), which transformers' causal LM skips on
load, are skipped with a note.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.qwen3_5_moe.config import Qwen35MoeConfig

KEYS = ExpertKeyMap("model.layers", default_layout="fused")
native_parts = KEYS.native_parts


def ignored_key(hf_key: str, config: Qwen35MoeConfig) -> str | bool:
    if hf_key.startswith("mtp."):
        return "of the multi-token-prediction layers (mtp.*; transformers' causal LM does not load them either)"
    return False


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: Qwen35MoeConfig,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(named_tensors, config.num_experts, expert_layout)
