"""GLM-4.5-MoE state-dict adapter: HF names <-> native names (grouped routed experts; MTP layers skipped).

Every name but the routed experts' is transformers' own (the dense MLPs, the shared experts, the router's
``e_score_correction_bias``). Experts are read in either layout of ``common/hf_experts.py`` and written one tensor
per expert by default, as the published GLM-4.5 checkpoints store them.

The multi-token-prediction layers a checkpoint declares (``num_nextn_predict_layers``) follow its last decoder layer
as ``model.layers.{num_hidden_layers + k}``. transformers' causal LM never runs them and this model does not hold
them: import skips their tensors, with a note naming the layer. A layer past the declared ones is not skipped, so
import refuses it as an unknown tensor.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.glm4_moe.config import Glm4MoeConfig

KEYS = ExpertKeyMap("model.layers", default_layout="per_expert")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
native_parts = KEYS.native_parts


def ignored_key(hf_key: str, config: Glm4MoeConfig) -> str | bool:
    """A tensor of a declared MTP layer: skipped, counted, said (the phrase names the layer)."""
    match = _LAYER.match(hf_key)
    if match is None:
        return False
    index = int(match.group(1))
    if not 0 <= index - config.num_hidden_layers < config.num_nextn_predict_layers:
        return False
    return f"of the multi-token-prediction layer model.layers.{index} (GLM-4.5's MTP layers are not trained here)"


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: Glm4MoeConfig,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(named_tensors, config.n_routed_experts, expert_layout)
