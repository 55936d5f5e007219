"""Qwen3-MoE configuration, read from a Hugging Face ``config.json`` (``Qwen3MoeConfig`` fields)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from openrecipes.models.common.activations import check_activation
from openrecipes.models.common.hf_config import (ROPE_PLACEMENTS, build_config, check_field_types, check_other_keys,
                                                 read_rope)
from openrecipes.utils import read_json

# Qwen3-MoE keys accepted only at the value that leaves the computation unchanged (hf_config.check_other_keys)
_NEUTRAL_HF_KEYS = {
    # transformers' Qwen3-MoE never reads layer_types (its window, when on, is every layer's): a sliding entry would
    # promise a per-layer choice neither computes
    "layer_types": (lambda v: v is None or all(t == "full_attention" for t in v), "every entry 'full_attention'"),
}
# transformers 5.x: sliding_window applies (to every layer) only with use_sliding_window true; max_window_layers is
# read by neither
_SLIDING_KEYS = {"use_sliding_window", "max_window_layers"}
_ROPE_KEYS = {"rope_theta", *ROPE_PLACEMENTS}
# the RoPE base transformers' Qwen3MoeConfig takes when config.json names none
TRANSFORMERS_DEFAULT_THETA = 10_000.0
# the window transformers' Qwen3MoeConfig takes when use_sliding_window is true and config.json names none
TRANSFORMERS_DEFAULT_WINDOW = 4096


@dataclass(kw_only=True, frozen=True)
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width, used only by layers in mlp_only_layers
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False  # transformers' default: the top-k softmax weights are not renormalised
    hidden_act: str = "silu"      # the expert activation (common.activations)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # layer i is a MoE layer unless i is in mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step (then
    # a dense gated MLP of intermediate_size), as transformers builds it
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None  # every layer attends to the last sliding_window tokens (itself included)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None  # its embedding row gets no gradient (transformers' padding_idx)
    initializer_range: float = 0.02  # std of the random initialisation of every matrix
    # the router load-balancing loss a transformers forward adds to its loss when output_router_logits is set
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        positive = ["vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                    "num_experts_per_tok"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name!r} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.decoder_sparse_step <= 0:
            raise ValueError(f"config field 'decoder_sparse_step' must be positive, got {self.decoder_sparse_step}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(f"mlp_only_layers {outside} are not layers of this model "
                             f"(0..{self.num_hidden_layers - 1})")
        if self.dense_layers and self.intermediate_size <= 0:
            raise ValueError(f"config field 'intermediate_size' must be positive for the dense layers "
                             f"{list(self.dense_layers)}, got {self.intermediate_size}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"config field 'sliding_window' must be positive, got {self.sliding_window}")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=true is not supported: Qwen3-MoE uses an untied LM head")
        check_activation(self.hidden_act)
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not (math.isfinite(self.initializer_range) and self.initializer_range > 0):
            raise ValueError(f"initializer_range must be a positive number, got {self.initializer_range}")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(f"router_aux_loss_coef must be a non-negative number, got {self.router_aux_loss_coef}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, index: int) -> bool:
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - len(self.dense_layers)

    # ---- parameter counts (docs/measure.md: N excludes the input embedding and all norms) ----
    def attention_params(self) -> int:
        q = self.hidden_size * self.num_attention_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_key_value_heads * self.head_dim
        o = self.num_attention_heads * self.head_dim * self.hidden_size
        bias = ((self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim + self.hidden_size
                if self.attention_bias else 0)
        return q + kv + o + bias

    def expert_params(self) -> int:
        """Parameters of one expert (gate, up, down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    def dense_mlp_params(self) -> int:
        """One dense layer's gated MLP."""
        return 3 * self.hidden_size * self.intermediate_size

    def norm_params(self) -> int:
        per_layer = 2 * self.hidden_size + 2 * self.head_dim  # input/post-attention norms, q/k norms
        return self.num_hidden_layers * per_layer + self.hidden_size  # + final norm

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def _layer_params(self, experts: int) -> int:
        """Every decoder layer's matrices, with ``experts`` of each MoE layer's experts counted."""
        moe = self.router_params() + experts * self.expert_params()
        dense = len(self.dense_layers)
        return (self.num_hidden_layers * self.attention_params() + self.num_moe_layers * moe
                + dense * self.dense_mlp_params())

    def total_params(self) -> int:
        return (self._layer_params(self.num_experts) + self.norm_params() + self.embedding_params()
                + self.lm_head_params())

    def frozen_params(self) -> int:
        """Parameters outside ``total_params`` because they are never trained: none in Qwen3-MoE."""
        return 0

    def active_params(self) -> int:
        """N: parameters touched per token, excluding the input embedding and all norms."""
        return self._layer_params(self.num_experts_per_tok) + self.lm_head_params()

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "Qwen3MoeConfig":
        model_type = raw.get("model_type")
        if model_type not in (None, "qwen3_moe"):
            raise ValueError(f"{source}: model_type is {model_type!r}, expected 'qwen3_moe'")
        known = {f.name for f in fields(cls)}
        raw = dict(raw)
        if "num_local_experts" in raw:  # transformers 5.x spelling of num_experts
            raw.setdefault("num_experts", raw.pop("num_local_experts"))
        check_other_keys(raw, handled=known | _ROPE_KEYS | _SLIDING_KEYS, family="Qwen3-MoE", source=source,
                         neutral=_NEUTRAL_HF_KEYS)
        kwargs: dict[str, Any] = {key: value for key, value in raw.items() if key in known}
        for key in ("mlp_only_layers", "head_dim"):  # transformers writes null for "none" and "the default"
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        if isinstance(kwargs.get("eos_token_id"), list):  # several stop tokens: the model reads none of them
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0] if kwargs["eos_token_id"] else None
        use_window = raw.get("use_sliding_window", False)
        if not isinstance(use_window, bool):
            raise ValueError(f"{source}: use_sliding_window must be true or false, got {use_window!r}")
        if not use_window:  # transformers drops the window then, whatever sliding_window says
            kwargs.pop("sliding_window", None)
        elif "sliding_window" not in raw:
            kwargs["sliding_window"] = TRANSFORMERS_DEFAULT_WINDOW
        check_field_types(cls, kwargs, source=source)
        if "mlp_only_layers" in kwargs:
            kwargs["mlp_only_layers"] = tuple(kwargs["mlp_only_layers"])
        kwargs["rope_theta"], _ = read_rope(raw, source=source, default_theta=TRANSFORMERS_DEFAULT_THETA)
        if "head_dim" not in kwargs and "hidden_size" in kwargs and "num_attention_heads" in kwargs:
            # transformers' default; a non-positive head count is refused below, by name
            kwargs["head_dim"] = kwargs["hidden_size"] // max(kwargs["num_attention_heads"], 1)
        return build_config(cls, kwargs, source=source)

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "Qwen3MoeConfig":
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        out.update(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
            max_window_layers=self.num_hidden_layers, use_sliding_window=self.sliding_window is not None,
            rope_scaling=None, attention_dropout=0.0, use_cache=True,
        )
        return out

