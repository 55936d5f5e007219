"""Muse Spark state-dict adapter: Hugging Face names <-> native names (grouped experts).

Pure tensor bookkeeping, no file I/O. Text-only mode: the decoder is ``model.language_model.*`` and the LM head
``lm_head.weight``. Experts are read in either layout of ``common/hf_experts.py`` and written **fused** by default:
per layer ``model.language_model.layers.{i}.mlp.experts.gate_up_proj`` (E, 2·F, L) and ``...experts.down_proj``
(E, L, F). The published checkpoint holds about 2,000 tensors, towers included, which only the fused layout fits
(the text decoder alone is 1,243 tensors fused, 48,735 with one tensor per expert).

Tensors of the other modalities are skipped on import (``ignored_key``) and never written on export:
``model.vision_tower.*`` (the NaViT image encoder), ``model.multi_modal_projector.*`` (the image adapter),
``model.audio_tower.*`` (the audio encoder) and ``model.audio_projector.*`` (the audio adapter). These names are
our choice; the published material names the components, not their tensors.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.muse_spark.config import MuseSparkConfig

TEXT_PREFIX = "model.language_model."
NON_TEXT_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "model.audio_tower.",
                     "model.audio_projector.")
KEYS = ExpertKeyMap("model.language_model.layers", default_layout="fused")
native_parts = KEYS.native_parts


def ignored_key(hf_key: str) -> bool:
    """True for tensors of the vision/audio towers and their adapters, which text-only mode does not load."""
    return hf_key.startswith(NON_TEXT_PREFIXES)


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: MuseSparkConfig,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(named_tensors, config.num_experts, expert_layout)


def expected_hf_shapes(config: MuseSparkConfig, expert_layout: str | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a text-only checkpoint for ``config`` with its shape (built on meta)."""
    from openrecipes.models.muse_spark.model import MuseSparkForCausalLM

    with torch.device("meta"):
        return KEYS.expected_hf_shapes(MuseSparkForCausalLM(config), config.num_experts, expert_layout)
