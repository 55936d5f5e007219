"""Qwen3-VL-MoE state-dict adapter: HF names <-> native names. Only the decoder's experts differ (grouped native
tensors); the vision tower's names are transformers' own. Experts are written fused, as transformers 5.x saves this
model (``gate_up_proj`` (E, 2F, D) and ``down_proj`` (E, D, F)); either layout is read."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.qwen3_vl_moe.config import Qwen3VLMoeConfig

KEYS = ExpertKeyMap("model.language_model.layers", default_layout="fused")
native_parts = KEYS.native_parts


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: Qwen3VLMoeConfig,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(named_tensors, config.text.num_experts, expert_layout)
