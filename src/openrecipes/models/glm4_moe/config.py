"""GLM-4.5-MoE configuration, read from a Hugging Face ``config.json`` (transformers' ``Glm4MoeConfig`` fields).

Only plain RoPE is computed, on the first ``partial_rotary_factor`` of each head: a ``rope_scaling`` (or
``rope_parameters``) of another type than ``default`` is refused by name. The multi-token-prediction layers a
checkpoint declares (``num_nextn_predict_layers``) are recorded, never built: transformers' causal LM runs none of
them and neither does this model (import skips their tensors with a note, models/glm4_moe/hf.py).
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

MODEL_TYPE = "glm4_moe"
# the RoPE base and rotary share transformers' Glm4MoeConfig takes when config.json names none
TRANSFORMERS_DEFAULT_THETA = 10_000.0
TRANSFORMERS_DEFAULT_ROTARY_FACTOR = 0.5
# transformers' attribute_map: a config.json may spell these fields by the other name
_ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
# keys accepted only at the value that leaves the computation unchanged (hf_config.check_other_keys)
_NEUTRAL_HF_KEYS = {
    # transformers' GLM-4.5 forward returns the router logits when asked but adds no load-balancing loss
    "output_router_logits": (lambda v: isinstance(v, bool), "true or false (the forward adds no router loss)"),
}


@dataclass(kw_only=True, frozen=True)
class Glm4MoeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int          # the dense MLP width of the first first_k_dense_replace layers
    moe_intermediate_size: int      # one routed expert's FFN width; the shared experts' is n_shared_experts times it
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int                   # config.json may leave it out: hidden_size // num_attention_heads
    n_routed_experts: int
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1                # expert groups; a token's experts come from its topk_group best groups
    topk_group: int = 1
    first_k_dense_replace: int = 1  # the first layers have a dense MLP, the rest a MoE block
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    use_qk_norm: bool = False       # an RMSNorm over each query and key head before RoPE
    attention_bias: bool = False    # biases on q/k/v (never on o_proj, as transformers builds it)
    partial_rotary_factor: float = TRANSFORMERS_DEFAULT_ROTARY_FACTOR  # RoPE rotates this share of each head
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = TRANSFORMERS_DEFAULT_THETA
    max_position_embeddings: int = 131072
    # the MTP layers the checkpoint declares (its layers num_hidden_layers .. + this - 1): never held by the model
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts",
                    "num_experts_per_tok", "n_group", "topk_group"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name!r} must be positive, got {getattr(self, name)}")
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"config field {name!r} must not be negative, got {getattr(self, name)}")
        if not self.rms_norm_eps > 0:  # NaN too: the norms divide by sqrt(mean square + eps)
            raise ValueError(f"config field 'rms_norm_eps' must be positive, got {self.rms_norm_eps}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                             f"({self.num_attention_heads})")
        self._check_routing()
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must give an even, non-zero "
                             f"rotary width of head_dim {self.head_dim} (got {self.rotary_dim})")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=true is not supported: GLM-4.5 uses an untied LM head")
        check_activation(self.hidden_act)
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        for name in ("initializer_range", "routed_scaling_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")

    def _check_routing(self) -> None:
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})")
        if self.n_routed_experts // self.n_group < 2:
            raise ValueError("n_group: each group needs at least 2 experts (a group scores by its best two)")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of "
                             f"topk_group ({self.topk_group}) groups")

    @property
    def rotary_dim(self) -> int:
        """The leading width of each query/key head RoPE rotates (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return max(self.num_hidden_layers - self.first_k_dense_replace, 0)

    # ---- parameter counts (docs/measure.md: N excludes the input embedding and all norms) ----
    def attention_params(self) -> int:
        """q, k, v (with their biases under attention_bias) and o (never a bias)."""
        d, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        bias = q + 2 * kv if self.attention_bias else 0
        return d * q + 2 * d * kv + q * d + bias

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size * self.n_shared_experts

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def router_params(self) -> int:
        return self.hidden_size * self.n_routed_experts  # the correction bias is frozen and not counted

    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size + (2 * self.head_dim if self.use_qk_norm else 0)

    def norm_params(self) -> int:
        return self.num_hidden_layers * self.norm_params_per_layer() + self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def _params(self, experts_per_layer: int) -> int:
        dense = min(self.first_k_dense_replace, self.num_hidden_layers) * self.dense_mlp_params()
        moe = self.num_moe_layers * (self.router_params() + self.shared_expert_params()
                                     + experts_per_layer * self.expert_params())
        return self.num_hidden_layers * self.attention_params() + dense + moe + self.lm_head_params()

    def total_params(self) -> int:
        return self._params(self.n_routed_experts) + self.norm_params() + self.embedding_params()

    def frozen_params(self) -> int:
        """Parameters outside ``total_params`` because they are never trained: the routers' correction biases."""
        return self.num_moe_layers * self.n_routed_experts

    def active_params(self) -> int:
        """N: parameters touched per token, excluding the input embedding and all norms."""
        return self._params(self.num_experts_per_tok)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "Glm4MoeConfig":
        model_type = raw.get("model_type")
        if model_type not in (None, MODEL_TYPE):
            raise ValueError(f"{source}: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        raw = _resolve_aliases(raw, source)
        known = {f.name for f in fields(cls)}  # rope_theta and partial_rotary_factor: read below, with the RoPE dict
        check_other_keys(raw, handled=known | {*ROPE_PLACEMENTS}, family="GLM-4.5-MoE", source=source,
                         neutral=_NEUTRAL_HF_KEYS)
        kwargs: dict[str, Any] = {k: v for k, v in raw.items()
                                  if k in known - {"rope_theta", "partial_rotary_factor", "head_dim"}}
        if isinstance(kwargs.get("eos_token_id"), list):  # several stop tokens: the model reads none of them
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0] if kwargs["eos_token_id"] else None
        check_field_types(cls, {**kwargs, **{k: raw[k] for k in ("rope_theta", "partial_rotary_factor", "head_dim")
                                             if raw.get(k) is not None}}, source=source)
        kwargs["rope_theta"], rope = read_rope(raw, source=source, default_theta=TRANSFORMERS_DEFAULT_THETA,
                                               extra_keys=frozenset({"partial_rotary_factor"}))
        kwargs["partial_rotary_factor"] = _rotary_factor(raw, rope, source)
        if raw.get("head_dim") is not None:  # transformers: the key, else hidden_size // num_attention_heads
            kwargs["head_dim"] = raw["head_dim"]
        elif isinstance(kwargs.get("hidden_size"), int) and isinstance(kwargs.get("num_attention_heads"), int):
            kwargs["head_dim"] = kwargs["hidden_size"] // max(kwargs["num_attention_heads"], 1)
        config = build_config(cls, kwargs, source=source)
        if config.n_shared_experts == 0:  # transformers keeps a zero-width shared MLP whose tensors this model lacks
            raise ValueError(f"{source}: n_shared_experts=0 is not supported for a Hugging Face checkpoint "
                             "(transformers builds a zero-width shared expert); give 1 or more")
        return config

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "Glm4MoeConfig":
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json of this model. It declares no MTP layer: the model holds none, so an export writes none."""
        out = asdict(self)
        del out["rope_theta"], out["partial_rotary_factor"]
        out.update(architectures=["Glm4MoeForCausalLM"], model_type=MODEL_TYPE, num_nextn_predict_layers=0,
                   rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                    "partial_rotary_factor": self.partial_rotary_factor},
                   attention_dropout=0.0, use_cache=True)
        return out


def _resolve_aliases(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """transformers' attribute_map names read as the fields they stand for (refused where both disagree)."""
    out = dict(raw)
    for alias, field in _ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if field in out and out[field] != value:
                raise ValueError(f"{source}: {alias}={value!r} contradicts {field}={out[field]!r}")
            out[field] = value
    return out


def _rotary_factor(raw: dict[str, Any], rope: dict[str, Any], source: str) -> float:
    """transformers takes the RoPE dict's partial_rotary_factor, else the top-level key, else 0.5; a top-level key
    that disagrees with the dict's is refused rather than silently overridden."""
    top, inner = raw.get("partial_rotary_factor"), rope.get("partial_rotary_factor")
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"{source}: partial_rotary_factor={top!r} contradicts the RoPE dict's "
                         f"partial_rotary_factor={inner!r}")
    value = inner if inner is not None else top if top is not None else TRANSFORMERS_DEFAULT_ROTARY_FACTOR
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{source}: partial_rotary_factor={value!r} must be a number")
    return float(value)
