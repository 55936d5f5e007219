"""DeepSeek-V3 state-dict adapter: HF names <-> native names (grouped routed experts, MTP layers).

Every name but the routed experts' and the MTP layers' is transformers' own (the dense MLPs, the shared experts, the
router's ``e_score_correction_bias``). Experts are read in either layout of ``common/hf_experts.py`` and written one
tensor per expert by default, as the published DeepSeek-V3 checkpoints store them.

The multi-token-prediction layers a checkpoint declares (``num_nextn_predict_layers``) follow its last decoder layer
as ``model.layers.{num_hidden_layers + k}``; natively they are ``model.mtp_layers.{same index}`` (model.py), so the
decoder layers stay what pipeline and expert parallelism split. Each stores copies of the main model's embedding
and head (``embed_tokens.weight``, ``shared_head.head.weight``), which the MTP layer shares: import maps them onto the
main tensors, which must be bitwise equal to them (``checkpoint/hf.py`` checks it), and export writes the main
tensors back under those names. A model that does not hold its MTP layers (``config.keep_mtp`` false: a run that does
not train them) skips their tensors on import, with a note naming them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap, Part
from openrecipes.models.deepseek_v3.config import DeepseekV3Config

KEYS = ExpertKeyMap("model.layers", default_layout="per_expert")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_NATIVE = re.compile(r"^model\.mtp_layers\.(\d+)\.")
# an MTP layer's copies of the main model's tensors: HF name within the layer -> the main tensor's native name
SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def _mtp_index(hf_key: str, config: DeepseekV3Config) -> int | None:
    """The layer index of a declared MTP layer's tensor, else None."""
    match = _LAYER.match(hf_key)
    if match is None:
        return None
    index = int(match.group(1))
    return index if 0 <= index - config.num_hidden_layers < config.num_nextn_predict_layers else None


def ignored_key(hf_key: str, config: DeepseekV3Config) -> str | bool:
    """A tensor of a declared MTP layer the model does not hold: skipped, counted, said (the phrase names the layer).
    A layer past the declared ones is not ignored, so import refuses it as an unknown tensor rather than dropping
    it."""
    index = _mtp_index(hf_key, config)
    if index is None or config.keep_mtp:
        return False
    return (f"of the multi-token-prediction layer model.layers.{index} (not trained by this run: the recipe has no "
            "`mtp` section)")


native_parts = KEYS.native_parts


def mtp_native_parts(hf_key: str, config: DeepseekV3Config) -> list[tuple[str, Part]] | None:
    """The native parts of a tensor of an MTP layer the model holds; None for any other tensor (``native_parts``)."""
    index = _mtp_index(hf_key, config)
    if index is None or not config.keep_mtp:
        return None
    within = hf_key[len(f"model.layers.{index}."):]
    if within in SHARED_COPIES:
        return [(SHARED_COPIES[within], None)]
    return [(f"model.mtp_layers.{index}." + name[len(f"model.layers.{index}."):], part)
            for name, part in KEYS.native_parts(hf_key)]


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: DeepseekV3Config,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(_with_mtp_names(named_tensors, config), config.n_routed_experts, expert_layout)


def _with_mtp_names(named_tensors: Iterable[tuple[str, torch.Tensor]],
                    config: DeepseekV3Config) -> Iterator[tuple[str, torch.Tensor]]:
    """MTP layers under their checkpoint names, and the copies of the shared tensors each one stores (clones: a
    safetensors file holds no two names over one storage)."""
    copies = {main: within for within, main in SHARED_COPIES.items()}
    for name, tensor in named_tensors:
        yield _MTP_NATIVE.sub(r"model.layers.\1.", name), tensor
        if name in copies:
            yield from ((f"model.layers.{i}.{copies[name]}", tensor.clone()) for i in config.mtp_layer_indices())


def with_mtp_kept(config: DeepseekV3Config, keep: bool) -> DeepseekV3Config:
    return dataclasses.replace(config, keep_mtp=keep)
