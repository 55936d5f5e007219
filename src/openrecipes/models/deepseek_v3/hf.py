"""DeepSeek-V3 state-dict adapter: HF names <-> native names (grouped routed experts).

Every name but the routed experts' is transformers' own (the dense MLPs, the shared experts, the router's
``e_score_correction_bias``). Experts are read in either layout of ``common/hf_experts.py`` and written one tensor per
expert by default, as the published DeepSeek-V3 checkpoints store them. The multi-token-prediction layers a published
checkpoint holds after the last decoder layer are skipped on import: transformers' causal LM forward runs none.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.deepseek_v3.config import DeepseekV3Config

KEYS = ExpertKeyMap("model.layers", default_layout="per_expert")
native_parts = KEYS.native_parts
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def ignored_key(hf_key: str, config: DeepseekV3Config) -> bool:
    """A multi-token-prediction layer's tensor (the config declares it): skipped, counted. A layer past those is not
    ignored, so import refuses it as an unknown tensor rather than dropping it."""
    match = _LAYER.match(hf_key)
    return match is not None and 0 <= int(match.group(1)) - config.num_hidden_layers < config.num_nextn_predict_layers


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: DeepseekV3Config,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(named_tensors, config.n_routed_experts, expert_layout)
