"""Qwen3-VL-MoE configuration, read from a Hugging Face ``config.json`` (``Qwen3VLMoeConfig``): a vision tower
(``vision_config``), a Qwen3-MoE text decoder (``text_config``, read by ``Qwen3MoeConfig``) and the image token ids.
Every key is honoured, known not to change the computation, or refused by name (``hf_config.check_other_keys``)."""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from openrecipes.models.common.activations import check_activation
from openrecipes.models.common.hf_config import ROPE_PLACEMENTS, check_field_types, check_other_keys, read_rope
from openrecipes.models.common.vision_geometry import PatchGeometry
from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig
from openrecipes.utils import read_json

_MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved"})
# the RoPE base transformers' Qwen3VLMoeTextConfig takes when text_config names none
_TRANSFORMERS_TEXT_THETA = 500_000.0
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass(kw_only=True, frozen=True)
class Qwen3VLMoeVisionConfig(PatchGeometry):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int          # the text decoder's hidden size: the merger projects into it
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304  # a square grid of learned position embeddings, resampled per image
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "in_channels", "num_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"vision_config.{name} must be positive, got {getattr(self, name)}")
        self.check_axial_heads()
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings={self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision_config.deepstack_visual_indexes {bad} are outside the blocks 0..{self.depth - 1}")
        check_activation(self.hidden_act, field="vision_config.hidden_act")

    def params(self) -> int:
        d, f, m = self.hidden_size, self.intermediate_size, self.merged_size
        patch = self.in_channels * self.temporal_patch_size * self.patch_size ** 2 * d + d
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return patch + self.num_position_embeddings * d + self.depth * block + self.projection_params()

    def projection_params(self) -> int:
        """The merger and the DeepStack mergers: what maps the tower's features into the decoder."""
        m = self.merged_size
        merger = lambda norm: 2 * norm + m * m + m + m * self.out_hidden_size + self.out_hidden_size  # noqa: E731
        return merger(self.hidden_size) + len(self.deepstack_visual_indexes) * merger(m)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str) -> "Qwen3VLMoeVisionConfig":
        raw = dict(raw)
        # transformers computes the vision tower's 2-D RoPE for type 'default' too (its default type is 'axial')
        theta, _ = read_rope(raw, source=f"{source} vision_config", default_theta=10000.0,
                             rope_types=("axial", "default"))
        known = {f.name for f in fields(cls)}
        check_other_keys(raw, handled=known | set(ROPE_PLACEMENTS), family="Qwen3-VL-MoE vision",
                         source=f"{source} vision_config")
        kwargs = {key: value for key, value in raw.items() if key in known}
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(kwargs.get(key), (list, tuple)):
                raise ValueError(f"{source}: vision_config.{key}={kwargs[key]!r}: only a single int is supported")
        check_field_types(cls, kwargs, source=f"{source} vision_config")
        kwargs["rope_theta"] = theta
        kwargs["deepstack_visual_indexes"] = tuple(kwargs.get("deepstack_visual_indexes", cls.deepstack_visual_indexes))
        missing = [f.name for f in fields(cls) if f.name not in kwargs and f.default is MISSING]
        if missing:
            raise ValueError(f"{source}: vision_config is missing required field(s) {missing}")
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        out["rope_parameters"] = {"rope_type": "axial", "rope_theta": out.pop("rope_theta")}
        out["model_type"] = "qwen3_vl_moe_vision"
        return out


@dataclass(kw_only=True, frozen=True)
class Qwen3VLMoeConfig:
    text: Qwen3MoeConfig
    vision: Qwen3VLMoeVisionConfig
    # M-RoPE: how many of the head_dim/2 rotary frequencies follow the temporal, height and width positions; the
    # height and width ones are interleaved with the temporal ones (frequency i is H when i % 3 == 1 and
    # i < 3·sections[1], W when i % 3 == 2 and i < 3·sections[2], else T)
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self) -> None:
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.text.head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must be three numbers summing to "
                             f"head_dim/2 = {self.text.head_dim // 2}")
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size ({self.vision.out_hidden_size}) must equal "
                             f"text_config.hidden_size ({self.text.hidden_size})")
        if len(self.vision.deepstack_visual_indexes) > self.text.num_hidden_layers:
            raise ValueError("more deepstack_visual_indexes than text decoder layers")
        for key in _TOKEN_KEYS:
            if not 0 <= getattr(self, key) < self.text.vocab_size:
                raise ValueError(f"{key}={getattr(self, key)} is outside the vocabulary "
                                 f"(0..{self.text.vocab_size - 1})")

    # the decoder's sizes, read by the code written against every family (planner, trainer, registry)
    def __getattr__(self, name: str) -> Any:
        if name in ("text", "vision") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.text, name)

    def frozen_params(self) -> int:
        """The vision tower: outside the decoder's counts (it is not part of the MoE decoder's N)."""
        return self.vision.params()

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "Qwen3VLMoeConfig":
        model_type = raw.get("model_type")
        if model_type not in (None, "qwen3_vl_moe"):
            raise ValueError(f"{source}: model_type is {model_type!r}, expected 'qwen3_vl_moe'")
        raw = dict(raw)
        check_other_keys(raw, handled={"text_config", "vision_config", "tie_word_embeddings", *_TOKEN_KEYS},
                         family="Qwen3-VL-MoE", source=source)
        if raw.get("tie_word_embeddings"):
            raise ValueError(f"{source}: tie_word_embeddings=true is not supported: Qwen3-VL-MoE uses an untied "
                             "LM head")
        if "text_config" not in raw or "vision_config" not in raw:
            raise ValueError(f"{source}: needs both text_config and vision_config")
        for key in ("text_config", "vision_config"):
            if not isinstance(raw[key], dict):
                raise ValueError(f"{source}: {key} must be a JSON object, got {type(raw[key]).__name__}")
        text = dict(raw["text_config"])
        # The text model has no LM head; tying is the top-level key's (transformers reads it there).
        text.pop("tie_word_embeddings", None)
        if text.get("model_type") == "qwen3_vl_moe_text":
            text["model_type"] = "qwen3_moe"
        # M-RoPE keys sit in rope_parameters (transformers 5.x) or rope_scaling (4.x, with rope_theta beside it);
        # the placement transformers reads decides the base and the sections, the text reader gets it alone
        theta, rope = read_rope(text, source=f"{source} text_config", default_theta=_TRANSFORMERS_TEXT_THETA,
                                extra_keys=_MROPE_KEYS)
        section = rope.get("mrope_section", list(cls.mrope_section))
        # transformers interleaves the sections whatever this flag says: only the value it computes is accepted
        if rope.get("mrope_interleaved", True) is not True:
            raise ValueError(f"{source}: text_config mrope_interleaved={rope['mrope_interleaved']!r} is not "
                             "supported: only true (the sections are always interleaved)")
        for key in ROPE_PLACEMENTS:
            text.pop(key, None)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        # transformers' Qwen3-VL-MoE text model has no window, whatever these say
        text.pop("use_sliding_window", None)
        text.pop("sliding_window", None)
        # the router of Qwen3-VL-MoE always renormalises its top-k weights
        text["norm_topk_prob"] = True
        return cls(text=Qwen3MoeConfig.from_hf_dict(text, source=f"{source} text_config"),
                   vision=Qwen3VLMoeVisionConfig.from_hf_dict(raw["vision_config"], source=source),
                   mrope_section=tuple(section),
                   **{key: raw[key] for key in _TOKEN_KEYS if key in raw})

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "Qwen3VLMoeConfig":
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        text = self.text.to_hf_dict()
        for key in ("architectures", "norm_topk_prob", "rope_scaling", "rope_theta"):
            text.pop(key, None)
        text.update(model_type="qwen3_vl_moe_text", rope_parameters={
            "rope_type": "default", "rope_theta": self.text.rope_theta, "mrope_section": list(self.mrope_section),
            "mrope_interleaved": True})
        return {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
                "text_config": text, "vision_config": self.vision.to_hf_dict(), "tie_word_embeddings": False,
                **{key: getattr(self, key) for key in _TOKEN_KEYS}}
