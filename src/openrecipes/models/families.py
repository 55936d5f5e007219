"""Model families: how to read a Hugging Face config, build the native model and map its tensor names.

The checkpoint code is written once against this interface; each family (Qwen3-MoE, Muse Spark) registers here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    model_types: tuple[str, ...]                              # config.json "model_type" values it reads
    config_class: type
    config_from_hf: Callable[[dict[str, Any], str], Any]      # (raw config.json, source name) -> config
    config_to_hf: Callable[[Any], dict[str, Any]]
    build: Callable[..., nn.Module]                           # build(config, *, device, dtype, seed)
    # HF name -> [(native name, part)]: which native parameter(s) it fills and where (common/hf_experts.Part)
    native_parts: Callable[[str], list[tuple[str, Any]]]
    # (native (name, tensor) stream, config, expert layout or None for the family's default) -> HF tensors
    to_hf: Callable[[Iterable[tuple[str, torch.Tensor]], Any, str | None], Iterator[tuple[str, torch.Tensor]]]
    # HF names outside the native model that import skips (and counts), e.g. a vision tower in text-only mode
    ignored_key: Callable[[str], bool] | None = None


_FAMILIES: list[ModelFamily] = []


def register_family(family: ModelFamily) -> None:
    _FAMILIES.append(family)


def family_for_model_type(model_type: str | None, *, source: str) -> ModelFamily:
    _ensure_registered()
    for family in _FAMILIES:
        if model_type in family.model_types:
            return family
    known = sorted(t for f in _FAMILIES for t in f.model_types)
    raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: {known}")


def family_for_config(config: Any) -> ModelFamily:
    _ensure_registered()
    for family in _FAMILIES:
        if isinstance(config, family.config_class):
            return family
    raise ValueError(f"no model family for config of type {type(config).__name__}")


def _ensure_registered() -> None:
    if _FAMILIES:
        return
    from openrecipes.models.qwen3_moe import hf as qwen3_hf
    from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig
    from openrecipes.models.qwen3_moe.model import build_qwen3_moe

    register_family(ModelFamily(
        model_types=("qwen3_moe",), config_class=Qwen3MoeConfig,
        config_from_hf=lambda raw, source: Qwen3MoeConfig.from_hf_dict(raw, source=source),
        config_to_hf=lambda config: config.to_hf_dict(), build=build_qwen3_moe,
        native_parts=qwen3_hf.native_parts,
        to_hf=qwen3_hf.to_hf,
    ))

    from openrecipes.models.muse_spark import hf as muse_hf
    from openrecipes.models.muse_spark.config import MODEL_TYPE, MuseSparkConfig
    from openrecipes.models.muse_spark.model import build_muse_spark

    register_family(ModelFamily(
        model_types=(MODEL_TYPE,), config_class=MuseSparkConfig,
        config_from_hf=lambda raw, source: MuseSparkConfig.from_hf_dict(raw, source=source),
        config_to_hf=lambda config: config.to_hf_dict(), build=build_muse_spark,
        native_parts=muse_hf.native_parts, to_hf=muse_hf.to_hf, ignored_key=muse_hf.ignored_key,
    ))
