"""gpt-oss configuration, read from a Hugging Face ``config.json`` (transformers' ``GptOssConfig`` fields).

Computed: attention with biases and per-head sinks, ``layer_types`` (sliding or full per layer, sliding ones within
``sliding_window`` tokens), plain or YaRN RoPE (transformers' default when config.json names none: YaRN, factor 32
over 4096 tokens, ``truncate`` false), the clamped SwiGLU experts (``swiglu_alpha``, ``swiglu_limit``) with biases,
and the router with a bias and a softmax over the top-k logits. Refused by name: a tied LM head, the router
load-balancing loss (``output_router_logits`` true), other RoPE types, any key transformers does not read or this
reader does not know. ``quantization_config`` (MXFP4 experts) is accepted: import dequantizes those tensors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from openrecipes.models.common.hf_config import (ROPE_PLACEMENTS, build_config, check_field_types, check_other_keys,
                                                 read_rope)
from openrecipes.models.common.rope_scaling import ROPE_SCALING_KEYS, RopeScaling
from openrecipes.utils import read_json

MODEL_TYPE = "gpt_oss"
LAYER_TYPES = ("sliding_attention", "full_attention")
TRANSFORMERS_DEFAULT_THETA = 150_000.0
# the RoPE transformers' GptOssConfig takes when config.json has neither rope_scaling nor rope_parameters
TRANSFORMERS_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096}
_UNREAD = (lambda v: True, "any value (transformers' gpt-oss does not read it)")
_NEUTRAL_HF_KEYS = {
    # the experts' gated form is fixed (ClampedSwiGLU); transformers' gpt-oss never reads hidden_act
    "hidden_act": _UNREAD,
    # keys of OpenAI's original config kept in the published config.json; transformers stores and never reads them
    "experts_per_token": _UNREAD, "initial_context_length": _UNREAD,
    # MXFP4 expert tensors: import dequantizes them (gpt_oss/mxfp4.py); export writes bf16/fp32 tensors, unquantized
    "quantization_config": (lambda v: isinstance(v, dict) and v.get("quant_method") == "mxfp4",
                            "an MXFP4 quantization_config (quant_method 'mxfp4')"),
    # transformers adds the router load-balancing loss only when it is asked for; it is not implemented here
    "output_router_logits": (lambda v: v is False or v is None, "false (the router load-balancing loss is not "
                                                                "implemented for gpt-oss)"),
    "router_aux_loss_coef": _UNREAD,  # read by transformers only with output_router_logits true, refused above
}


# transformers' GptOssConfig class defaults for keys a config.json may leave out (absent is not null: null derives
# head_dim from hidden_size / heads and the key heads from the heads; absent takes these)
_ABSENT_DEFAULTS = {"head_dim": 64, "num_key_value_heads": 8}


@dataclass(kw_only=True, frozen=True)
class GptOssConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int          # each expert's FFN width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...] = ()   # () : transformers' default, sliding on even layers, full on odd ones
    sliding_window: int | None = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = TRANSFORMERS_DEFAULT_THETA
    rope_scaling: RopeScaling = field(default_factory=lambda: RopeScaling.from_hf(
        TRANSFORMERS_DEFAULT_ROPE, max_position_embeddings=131072, source="GptOssConfig default"))
    max_position_embeddings: int = 131072
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None  # its embedding row gets no gradient (transformers' padding_idx)

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name!r} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts "
                             f"({self.num_local_experts})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} for each of the {self.num_hidden_layers} "
                             f"layers, got {list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and (self.sliding_window is None or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive integer for sliding layers, got {self.sliding_window}")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=true is not supported: gpt-oss uses an untied LM head")
        for name in ("swiglu_alpha", "swiglu_limit", "initializer_range", "rms_norm_eps"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"config field {name!r} must be a positive number, got {getattr(self, name)}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")

    def window(self, index: int) -> int | None:
        """The attention window of layer ``index``: ``sliding_window`` on sliding layers, None on full ones."""
        return self.sliding_window if self.layer_types[index] == "sliding_attention" else None

    # ---- parameter counts (docs/measure.md: N excludes the input embedding and all norms) ----
    def attention_params(self) -> int:
        q_width, kv_width = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        matrices = 2 * self.hidden_size * q_width + 2 * self.hidden_size * kv_width
        bias = q_width + 2 * kv_width + self.hidden_size if self.attention_bias else 0
        return matrices + bias + self.num_attention_heads  # + the sinks

    def expert_params(self) -> int:
        """One expert: gate, up and down matrices and their biases."""
        return 3 * self.hidden_size * self.intermediate_size + 2 * self.intermediate_size + self.hidden_size

    def router_params(self) -> int:
        return self.hidden_size * self.num_local_experts + self.num_local_experts

    def norm_params(self) -> int:
        return self.num_hidden_layers * 2 * self.hidden_size + self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def _layer_params(self, experts: int) -> int:
        return self.num_hidden_layers * (self.attention_params() + self.router_params()
                                         + experts * self.expert_params())

    def total_params(self) -> int:
        return (self._layer_params(self.num_local_experts) + self.norm_params() + self.embedding_params()
                + self.lm_head_params())

    def frozen_params(self) -> int:
        return 0

    def active_params(self) -> int:
        """N: parameters touched per token, excluding the input embedding and all norms."""
        return self._layer_params(self.num_experts_per_tok) + self.lm_head_params()

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "GptOssConfig":
        model_type = raw.get("model_type")
        if model_type not in (None, MODEL_TYPE):
            raise ValueError(f"{source}: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        raw = dict(raw)
        if "num_experts" in raw:  # transformers' attribute_map spelling of num_local_experts
            raw.setdefault("num_local_experts", raw.pop("num_experts"))
        known = {f.name for f in fields(cls)} - {"rope_scaling"}
        check_other_keys(raw, handled=known | {"rope_theta", *ROPE_PLACEMENTS}, family="gpt-oss", source=source,
                         neutral=_NEUTRAL_HF_KEYS)
        kwargs: dict[str, Any] = {key: value for key, value in raw.items() if key in known}
        for key, class_default in _ABSENT_DEFAULTS.items():  # absent: the class's default; null: derived below
            if key not in raw:
                kwargs[key] = class_default
        for key in ("head_dim", "num_key_value_heads", "layer_types"):  # null: transformers' derived value
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        if "sliding_window" not in raw:
            kwargs["sliding_window"] = 128
        if isinstance(kwargs.get("eos_token_id"), list):  # several stop tokens: the model reads none of them
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0] if kwargs["eos_token_id"] else None
        check_field_types(cls, kwargs, source=source)
        if "layer_types" in kwargs:
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        if "num_key_value_heads" not in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "head_dim" not in kwargs and "hidden_size" in kwargs and "num_attention_heads" in kwargs:
            kwargs["head_dim"] = kwargs["hidden_size"] // max(kwargs["num_attention_heads"], 1)
        kwargs["rope_theta"], kwargs["rope_scaling"] = _read_rope(raw, kwargs, source)
        return build_config(cls, kwargs, source=source)

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "GptOssConfig":
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["num_experts_per_tok"] = self.num_experts_per_tok
        out.update(architectures=["GptOssForCausalLM"], model_type=MODEL_TYPE,
                   rope_scaling=self.rope_scaling.to_hf() or {"rope_type": "default"},
                   attention_dropout=0.0, use_cache=True, hidden_act="silu", output_router_logits=False)
        return out


def _read_rope(raw: dict[str, Any], kwargs: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    """rope_theta and the scaled RoPE as transformers computes them (its YaRN default when none is named)."""
    theta, rope = read_rope(raw, source=source, default_theta=TRANSFORMERS_DEFAULT_THETA,
                            rope_types=("default", "yarn"), extra_keys=ROPE_SCALING_KEYS["yarn"])
    if not any(raw.get(placement) for placement in ROPE_PLACEMENTS):
        rope = dict(TRANSFORMERS_DEFAULT_ROPE)
    kind = rope.get("rope_type", rope.get("type", "default"))
    for key in set(rope) - {"rope_type", "type", "rope_theta"}:
        if key not in ROPE_SCALING_KEYS.get(kind, ()):
            raise ValueError(f"{source}: rope_scaling.{key}={rope[key]!r} is not read by {kind} RoPE")
    scaling = RopeScaling.from_hf(rope, max_position_embeddings=kwargs.get("max_position_embeddings", 131072),
                                  source=source)
    return theta, scaling
