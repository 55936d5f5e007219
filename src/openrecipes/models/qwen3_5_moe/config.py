"""Qwen3.5-MoE text configuration, read from a Hugging Face ``config.json`` (transformers' ``Qwen3_5MoeTextConfig``
fields, model_type ``qwen3_5_moe_text``).

Layers are of two kinds (``layer_types``): ``linear_attention`` (Gated DeltaNet: the ``linear_*`` fields) and
``full_attention`` (gated softmax attention, RoPE on the first ``partial_rotary_factor`` of each head). Every layer
holds the MoE block: ``num_experts`` routed experts (softmax top-k, always renormalised) plus one shared expert under
a sigmoid gate. Only plain RoPE is computed; ``mrope_section``/``mrope_interleaved`` in the RoPE dict are accepted
because a text-only model gives its three position axes the same ids, where interleaved M-RoPE is plain RoPE.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from openrecipes.models.common.activations import check_activation
from openrecipes.models.common.hf_config import (ROPE_PLACEMENTS, build_config, check_field_types, check_other_keys,
                                                 read_rope)
from openrecipes.utils import read_json

MODEL_TYPE = "qwen3_5_moe_text"
LAYER_TYPES = ("linear_attention", "full_attention")
# transformers' Qwen3_5MoeTextConfig defaults where config.json names none
TRANSFORMERS_DEFAULT_THETA = 10_000.0
TRANSFORMERS_DEFAULT_ROTARY_FACTOR = 0.25
TRANSFORMERS_DEFAULT_INTERVAL = 4  # full_attention_interval: every fourth layer is full attention
_MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved", "partial_rotary_factor"})
# keys whose value transformers' causal LM never reads (hf_config.check_other_keys' neutral table)
_NEUTRAL_HF_KEYS = {
    # the multi-token-prediction layers of the published checkpoints: transformers builds none and skips their
    # tensors (mtp.*), as import does here
    "mtp_num_hidden_layers": (lambda v: isinstance(v, int), "an integer (MTP layers are not built)"),
    "mtp_use_dedicated_embeddings": (lambda v: isinstance(v, bool), "true or false (MTP layers are not built)"),
}


@dataclass(kw_only=True, frozen=True)
class Qwen35MoeConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]        # per layer: "linear_attention" or "full_attention"
    num_attention_heads: int            # full attention
    num_key_value_heads: int
    head_dim: int = 256
    partial_rotary_factor: float = TRANSFORMERS_DEFAULT_ROTARY_FACTOR
    attention_bias: bool = False        # biases on q/k/v/o of the full-attention layers
    linear_conv_kernel_dim: int = 4     # Gated DeltaNet: the causal depthwise convolution's width
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32    # a multiple of linear_num_key_heads (query/key heads are shared)
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    hidden_act: str = "silu"            # experts, shared expert, and the convolution's activation
    rms_norm_eps: float = 1e-6
    rope_theta: float = TRANSFORMERS_DEFAULT_THETA
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    output_router_logits: bool = False  # transformers adds the load-balancing loss to its loss when true
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
                    "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name!r} must be positive, got {getattr(self, name)}")
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"config field 'layer_types' must give one of {LAYER_TYPES} for each of the "
                             f"{self.num_hidden_layers} layers, got {list(self.layer_types)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_key_heads ({self.linear_num_key_heads}) must divide "
                             f"linear_num_value_heads ({self.linear_num_value_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must give an even, non-zero "
                             f"rotary width of head_dim {self.head_dim} (got {self.rotary_dim})")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=true is not supported: Qwen3.5-MoE uses an untied LM head")
        check_activation(self.hidden_act)
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config field 'rms_norm_eps' must be positive, got {self.rms_norm_eps}")
        if not (math.isfinite(self.initializer_range) and self.initializer_range > 0):
            raise ValueError(f"initializer_range must be a positive number, got {self.initializer_range}")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(f"router_aux_loss_coef must be a non-negative number, got {self.router_aux_loss_coef}")

    @property
    def rotary_dim(self) -> int:
        """The leading width of each query/key head RoPE rotates (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, index: int) -> bool:
        return self.layer_types[index] == "full_attention"

    @property
    def num_full_attention_layers(self) -> int:
        return sum(map(self.is_full_attention, range(self.num_hidden_layers)))

    # ---- parameter counts (docs/measure.md: N excludes the input embedding and all norms) ----
    def attention_params(self) -> int:
        """A full-attention layer: q (with its output gate: 2 x heads x head_dim), k, v, o and their biases."""
        d, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        bias = 2 * q + 2 * kv + d if self.attention_bias else 0
        return d * 2 * q + 2 * d * kv + q * d + bias

    def linear_attention_params(self) -> int:
        """A Gated DeltaNet layer's matrices: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, the
        convolution, and the per-head A_log and dt_bias (its gated norm is counted with the norms)."""
        d, keys = self.hidden_size, self.linear_num_key_heads * self.linear_key_head_dim
        values, heads = self.linear_num_value_heads * self.linear_value_head_dim, self.linear_num_value_heads
        conv = (2 * keys + values) * self.linear_conv_kernel_dim
        return d * (2 * keys + values) + d * values + 2 * d * heads + values * d + conv + 2 * heads

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def shared_expert_params(self) -> int:
        """The shared expert and its sigmoid gate (hidden_size -> 1)."""
        return 3 * self.hidden_size * self.shared_expert_intermediate_size + self.hidden_size

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    def norm_params_per_layer(self, index: int) -> int:
        """Input and post-attention norms; q/k norms (full attention) or the gated output norm (linear)."""
        own = 2 * self.head_dim if self.is_full_attention(index) else self.linear_value_head_dim
        return 2 * self.hidden_size + own

    def norm_params(self) -> int:
        return sum(map(self.norm_params_per_layer, range(self.num_hidden_layers))) + self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def mixer_params(self) -> int:
        """Every layer's attention or linear attention, summed."""
        full = self.num_full_attention_layers
        return full * self.attention_params() + (self.num_hidden_layers - full) * self.linear_attention_params()

    def _params(self, experts: int) -> int:
        moe = self.router_params() + self.shared_expert_params() + experts * self.expert_params()
        return self.mixer_params() + self.num_hidden_layers * moe + self.lm_head_params()

    def total_params(self) -> int:
        return self._params(self.num_experts) + self.norm_params() + self.embedding_params()

    def frozen_params(self) -> int:
        """Parameters outside ``total_params`` because they are never trained: none."""
        return 0

    def active_params(self) -> int:
        """N: parameters touched per token, excluding the input embedding and all norms."""
        return self._params(self.num_experts_per_tok)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "Qwen35MoeConfig":
        model_type = raw.get("model_type")
        if model_type not in (None, MODEL_TYPE):
            raise ValueError(f"{source}: model_type is {model_type!r}, expected {MODEL_TYPE!r} (the text config; "
                             "the image-text checkpoint's qwen3_5_moe is not read)")
        own = {"rope_theta", "partial_rotary_factor", "layer_types", "head_dim"}
        known = {f.name for f in fields(cls)}
        check_other_keys(raw, handled=known | {*ROPE_PLACEMENTS, "full_attention_interval"}, family="Qwen3.5-MoE",
                         source=source, neutral=_NEUTRAL_HF_KEYS)
        kwargs: dict[str, Any] = {k: v for k, v in raw.items() if k in known - own}
        if isinstance(kwargs.get("eos_token_id"), list):  # several stop tokens: the model reads none of them
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0] if kwargs["eos_token_id"] else None
        check_field_types(cls, {**kwargs, **{k: raw[k] for k in own if raw.get(k) is not None}}, source=source)
        kwargs["rope_theta"], rope = read_rope(raw, source=source, default_theta=TRANSFORMERS_DEFAULT_THETA,
                                               extra_keys=_MROPE_KEYS)
        kwargs["partial_rotary_factor"] = _rotary_factor(raw, rope, source)
        if raw.get("head_dim") is not None:
            kwargs["head_dim"] = raw["head_dim"]
        kwargs["layer_types"] = _layer_types(raw, source)
        return build_config(cls, kwargs, source=source)

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "Qwen35MoeConfig":
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["rope_theta"], out["partial_rotary_factor"]
        out.update(architectures=["Qwen3_5MoeForCausalLM"], model_type=MODEL_TYPE, layer_types=list(self.layer_types),
                   rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                    "partial_rotary_factor": self.partial_rotary_factor},
                   attention_dropout=0.0, use_cache=True)
        return out


def _layer_types(raw: dict[str, Any], source: str) -> tuple[str, ...]:
    """transformers: layer_types when given, else every full_attention_interval-th layer full attention."""
    layers = raw.get("num_hidden_layers")
    interval = raw.get("full_attention_interval", TRANSFORMERS_DEFAULT_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        raise ValueError(f"{source}: full_attention_interval={interval!r} must be a positive integer")
    if raw.get("layer_types") is not None:
        if "full_attention_interval" in raw:  # transformers then ignores the interval: refuse a contradiction
            pattern = [(i + 1) % interval == 0 for i in range(len(raw["layer_types"]))]
            if pattern != [t == "full_attention" for t in raw["layer_types"]]:
                raise ValueError(f"{source}: full_attention_interval={interval} contradicts layer_types")
        return tuple(raw["layer_types"])
    if not isinstance(layers, int) or isinstance(layers, bool):
        return ()  # refused by name below (num_hidden_layers missing or of the wrong type)
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))


def _rotary_factor(raw: dict[str, Any], rope: dict[str, Any], source: str) -> float:
    """The RoPE dict's partial_rotary_factor, else the top-level key, else transformers' 0.25; a top-level key that
    disagrees with the dict's is refused rather than silently overridden."""
    top, inner = raw.get("partial_rotary_factor"), rope.get("partial_rotary_factor")
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"{source}: partial_rotary_factor={top!r} contradicts the RoPE dict's "
                         f"partial_rotary_factor={inner!r}")
    value = inner if inner is not None else top if top is not None else TRANSFORMERS_DEFAULT_ROTARY_FACTOR
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{source}: partial_rotary_factor={value!r} must be a number")
    return float(value)
