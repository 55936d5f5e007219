"""Muse Spark state-dict adapter: Hugging Face names <-> native names (grouped experts).

Pure tensor bookkeeping, no file I/O. Text-only mode: the decoder is ``model.language_model.*`` and the LM head
``lm_head.weight``. Experts are read in either layout of ``common/hf_experts.py`` and written **fused** by default:
per layer ``model.language_model.layers.{i}.mlp.experts.gate_up_proj`` (E, 2·F, L) and ``...experts.down_proj``
(E, L, F). The published checkpoint holds about 2,000 tensors, towers included, which only the fused layout fits
(the text decoder alone is 1,243 tensors fused, 48,735 with one tensor per expert).

The towers keep their module names: ``model.vision_tower.*`` (the NaViT image encoder and its adapter),
``model.multi_modal_projector.*`` (the projection into the decoder), ``model.audio_tower.*`` (the audio encoder) and
``model.audio_projector.*`` (its projector). These names are our choice; the published material names the
components, not their tensors. In text-only mode (``text_only``: the config without its towers) import skips them
(``ignored_key``) and export never writes them; in full-checkpoint mode they are parameters like the decoder's.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.muse_spark.config import MuseSparkConfig

TEXT_PREFIX = "model.language_model."
TOWER_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "model.audio_tower.",
                  "model.audio_projector.")
KEYS = ExpertKeyMap("model.language_model.layers", default_layout="fused")
native_parts = KEYS.native_parts


def ignored_key(hf_key: str, config: MuseSparkConfig) -> bool:
    """True for a tensor of a tower (with its adapter) that ``config`` does not hold: every tower in text-only mode.
    A tower the config holds is read whole, and any name in it the model lacks is an error."""
    vision, audio = TOWER_PREFIXES[:2], TOWER_PREFIXES[2:]
    return (config.vision is None and hf_key.startswith(vision)) or (config.audio is None and hf_key.startswith(audio))


def text_only(config: MuseSparkConfig) -> MuseSparkConfig:
    return config.text_only()


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: MuseSparkConfig,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(named_tensors, config.num_experts, expert_layout)


def expected_hf_shapes(config: MuseSparkConfig, expert_layout: str | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a checkpoint for ``config`` (text-only when it has no towers) with its shape."""
    from openrecipes.models.muse_spark.model import MuseSparkForCausalLM

    with torch.device("meta"):
        return KEYS.expected_hf_shapes(MuseSparkForCausalLM(config), config.num_experts, expert_layout)
