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

import re

import torch

from openrecipes.models.muse_spark.config import MuseSparkConfig

TEXT_PREFIX = "model.language_model."
NON_TEXT_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "model.audio_tower.",
                     "model.audio_projector.")

_HF_EXPERT = re.compile(
    r"^(model\.language_model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_NATIVE_EXPERT = re.compile(r"^(model\.language_model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


def ignored_key(hf_key: str) -> bool:
    """True for tensors of the vision/audio towers and their adapters, which text-only mode does not load."""
    return hf_key.startswith(NON_TEXT_PREFIXES)


def native_key(hf_key: str) -> tuple[str, int | None]:
    """Native parameter name of an HF tensor, and its expert index when it is one expert's slice."""
    match = _HF_EXPERT.match(hf_key)
    if match:
        return f"{match.group(1)}.{match.group(3)}", int(match.group(2))
    return hf_key, None


def hf_keys(native_name: str, num_experts: int) -> list[str]:
    """The HF tensor names that make up one native parameter (E names for a grouped expert tensor)."""
    match = _NATIVE_EXPERT.match(native_name)
    if match:
        return [f"{match.group(1)}.{e}.{match.group(2)}.weight" for e in range(num_experts)]
    return [native_name]


def to_hf(native_name: str, tensor: torch.Tensor, config: MuseSparkConfig) -> list[tuple[str, torch.Tensor]]:
    """Split one native tensor into its HF tensors (contiguous copies, ready for safetensors); dtype kept."""
    names = hf_keys(native_name, config.num_experts)
    if len(names) == 1:
        return [(names[0], tensor.contiguous())]
    if tensor.shape[0] != config.num_experts:
        raise ValueError(f"{native_name}: expected {config.num_experts} experts in dim 0, "
                         f"got shape {tuple(tensor.shape)}")
    return [(name, tensor[e].contiguous()) for e, name in enumerate(names)]


def expected_hf_shapes(config: MuseSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a text-only checkpoint for ``config`` with its shape (built on meta)."""
    from openrecipes.models.muse_spark.model import MuseSparkForCausalLM

    with torch.device("meta"):
        model = MuseSparkForCausalLM(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        for hf_name, piece in to_hf(name, param, config):
            shapes[hf_name] = tuple(piece.shape)
    return shapes
