"""Qwen3-MoE state-dict adapter: HF names <-> native names (grouped experts).

Experts are read in either layout of ``common/hf_experts.py`` and written one tensor per expert by default, as
the published Qwen3-MoE checkpoints and ``transformers``' ``save_pretrained`` store them.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig

KEYS = ExpertKeyMap("model.layers", default_layout="per_expert")
native_parts = KEYS.native_parts


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: Qwen3MoeConfig,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(named_tensors, config.num_experts, expert_layout)


def expected_hf_shapes(config: Qwen3MoeConfig, expert_layout: str | None = None) -> dict[str, tuple[int, ...]]:
    from openrecipes.models.qwen3_moe.model import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return KEYS.expected_hf_shapes(Qwen3MoeForCausalLM(config), config.num_experts, expert_layout)
