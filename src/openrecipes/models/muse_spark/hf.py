"""Muse Spark state-dict adapter: Hugging Face names (one tensor per expert) <-> native names (grouped experts).

Pure tensor bookkeeping, no file I/O. Text-only mode: the decoder is ``model.language_model.*`` and the LM head
``lm_head.weight``; HF stores ``model.language_model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``
of shape (out, in), native stacks them into ``...mlp.experts.{gate,up,down}_proj`` of shape (E, out, in).

Tensors of the other modalities are skipped on import (``ignored_key``) and never written on export:
``model.vision_tower.*`` (the NaViT image encoder), ``model.multi_modal_projector.*`` (the image adapter),
``model.audio_tower.*`` (the audio encoder) and ``model.audio_projector.*`` (the audio adapter). These names are
our choice; the published material names the components, not their tensors.
"""

from __future__ import annotations

import torch

from openrecipes.models.common.hf_experts import ExpertKeyMap
from openrecipes.models.muse_spark.config import MuseSparkConfig

TEXT_PREFIX = "model.language_model."
NON_TEXT_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "model.audio_tower.",
                     "model.audio_projector.")
KEYS = ExpertKeyMap("model.language_model.layers")
native_key = KEYS.native_key
hf_keys = KEYS.hf_keys


def ignored_key(hf_key: str) -> bool:
    """True for tensors of the vision/audio towers and their adapters, which text-only mode does not load."""
    return hf_key.startswith(NON_TEXT_PREFIXES)


def to_hf(native_name: str, tensor: torch.Tensor, config: MuseSparkConfig) -> list[tuple[str, torch.Tensor]]:
    return KEYS.to_hf(native_name, tensor, config.num_experts)


def expected_hf_shapes(config: MuseSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a text-only checkpoint for ``config`` with its shape (built on meta)."""
    from openrecipes.models.muse_spark.model import MuseSparkForCausalLM

    with torch.device("meta"):
        return KEYS.expected_hf_shapes(MuseSparkForCausalLM(config), config.num_experts)
