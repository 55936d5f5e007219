"""DeepSeek-V3 configuration, read from a Hugging Face ``config.json`` (``DeepseekV3Config`` fields).

Only plain RoPE is computed: a ``rope_scaling`` (or ``rope_parameters``) of another type than ``default`` (YaRN, as
the published DeepSeek-V3 checkpoints have) is refused by name, never computed as plain RoPE.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from openrecipes.models.common.activations import check_activation
from openrecipes.models.common.hf_config import (ROPE_PLACEMENTS, build_config, check_field_types, check_other_keys,
                                                 read_rope)
from openrecipes.models.common.rope_scaling import ROPE_SCALING_KEYS, RopeScaling, yarn_mscale
from openrecipes.utils import read_json

MODEL_TYPE = "deepseek_v3"
# the RoPE base transformers' DeepseekV3Config takes when config.json names none
TRANSFORMERS_DEFAULT_THETA = 10_000.0
# keys transformers writes that follow from other fields: accepted only where they agree (checked in from_hf_dict)
_DERIVED_KEYS = {"qk_head_dim", "head_dim"}
# keys accepted only at the value that leaves the computation unchanged (hf_config.check_other_keys)
_NEUTRAL_HF_KEYS = {
    "pretraining_tp": (lambda v: v in (None, 1), "1 (transformers' DeepSeek-V3 never reads it)"),
    "output_router_logits": (lambda v: v in (None, False), "false (the forward adds no router loss)"),
    # the original checkpoints' own spellings of what this family computes
    "scoring_func": (lambda v: v == "sigmoid", "'sigmoid'"),
    "topk_method": (lambda v: v == "noaux_tc", "'noaux_tc' (group-limited top-k with the correction bias)"),
    "moe_layer_freq": (lambda v: v == 1, "1 (every layer from first_k_dense_replace on is a MoE layer)"),
    "ep_size": (lambda v: isinstance(v, int) and v >= 1, "a positive integer (a deployment hint)"),
}


@dataclass(kw_only=True, frozen=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int          # the dense MLP width of the first first_k_dense_replace layers
    moe_intermediate_size: int      # one routed expert's FFN width; the shared experts' is n_shared_experts times it
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int        # equal to num_attention_heads: latent attention expands keys to every head
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int                    # expert groups; a token's experts come from its topk_group best groups
    topk_group: int
    first_k_dense_replace: int      # the first layers have a dense MLP, the rest a MoE block
    kv_lora_rank: int               # the compressed key/value width
    q_lora_rank: int | None         # the compressed query width; None: one full query projection
    qk_nope_head_dim: int           # per head: the query/key part without position
    qk_rope_head_dim: int           # per head: the part rotated by RoPE (one key part shared by every head)
    v_head_dim: int
    routed_scaling_factor: float = 2.5  # transformers' default
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = TRANSFORMERS_DEFAULT_THETA
    rope_interleave: bool = True    # the rope part is laid out in adjacent pairs (DeepSeek's checkpoints)
    max_position_embeddings: int = 4096
    # the multi-token-prediction layers the checkpoint declares (its layers num_hidden_layers .. + this - 1; mtp.py);
    # transformers' causal LM forward runs none of them, nor does ours when it computes logits
    num_nextn_predict_layers: int = 0
    # the checkpoint's scaled RoPE (linear or YaRN, as transformers computes them; common/rope_scaling.py)
    rope_scaling: RopeScaling = RopeScaling()
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    # not a config.json key: whether the model holds the declared MTP layers (``mtp_layers``). A config read from a
    # config.json holds them (import keeps them, export writes them back); a registered size and a training run
    # that does not train them (no ``mtp`` in the recipe) do not: import then skips their tensors with a note
    keep_mtp: bool = False

    def __post_init__(self) -> None:
        positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                    "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name!r} must be positive, got {getattr(self, name)}")
        for name in ("n_shared_experts", "qk_nope_head_dim", "first_k_dense_replace", "num_nextn_predict_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"config field {name!r} must not be negative, got {getattr(self, name)}")
        if not self.rms_norm_eps > 0:  # NaN too: the norms divide by sqrt(mean square + eps)
            raise ValueError(f"config field 'rms_norm_eps' must be positive, got {self.rms_norm_eps}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                             f"({self.num_attention_heads}): latent attention gives every head its own key and value")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})")
        if self.n_routed_experts // self.n_group < 2:
            raise ValueError("n_group: each group needs at least 2 experts (a group scores by its best two)")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of "
                             f"topk_group ({self.topk_group}) groups")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=true is not supported: DeepSeek-V3 uses an untied LM head")
        check_activation(self.hidden_act)
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        for name in ("initializer_range", "routed_scaling_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The per-head width attention scores are taken over (what a run records and MFU counts); transformers'
        ``head_dim`` key is the RoPE part alone."""
        return self.qk_head_dim

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return max(self.num_hidden_layers - self.first_k_dense_replace, 0)

    @property
    def mtp_layers(self) -> int:
        """The multi-token-prediction layers the model holds: the declared ones when ``keep_mtp``, else none."""
        return self.num_nextn_predict_layers if self.keep_mtp else 0

    def mtp_layer_indices(self) -> range:
        """The global layer indices of the MTP layers the model holds (their checkpoint names' ``model.layers.i``)."""
        return range(self.num_hidden_layers, self.num_hidden_layers + self.mtp_layers)

    # ---- parameter counts (docs/measure.md: N excludes the input embedding and all norms) ----
    def attention_params(self) -> int:
        """Projections of one layer: the head-split ones (q or q_b, kv_b, o) and the latent ones (q_a, kv_a)."""
        return self.attention_head_params() + self.attention_latent_params()

    def attention_head_params(self) -> int:
        d, h = self.hidden_size, self.num_attention_heads
        q_in = d if self.q_lora_rank is None else self.q_lora_rank
        q = q_in * h * self.qk_head_dim
        kv_b = self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        o = h * self.v_head_dim * d + (d if self.attention_bias else 0)
        return q + kv_b + o

    def attention_latent_params(self) -> int:
        d, bias = self.hidden_size, self.attention_bias
        q_a = 0 if self.q_lora_rank is None else d * self.q_lora_rank + (self.q_lora_rank if bias else 0)
        kv_width = self.kv_lora_rank + self.qk_rope_head_dim
        return q_a + d * kv_width + (kv_width if bias else 0)

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size * self.n_shared_experts

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def router_params(self) -> int:
        return self.hidden_size * self.n_routed_experts  # the correction bias is frozen and not counted

    def norm_params(self) -> int:
        latent_norms = self.kv_lora_rank + (self.q_lora_rank or 0)
        layers = self.num_hidden_layers + self.mtp_layers  # an MTP layer: a decoder layer's norms and 3 of its own
        return layers * (2 * self.hidden_size + latent_norms) + (1 + 3 * self.mtp_layers) * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def _params(self, experts_per_layer: int) -> int:
        dense = self.first_k_dense_replace * self.dense_mlp_params() if self.num_moe_layers else (
            self.num_hidden_layers * self.dense_mlp_params())
        moe = self.num_moe_layers * (self.router_params() + self.shared_expert_params()
                                     + experts_per_layer * self.expert_params())
        return self.num_hidden_layers * self.attention_params() + dense + moe + self.lm_head_params()

    def mtp_layer_params(self, experts_per_layer: int) -> int:
        """One MTP layer without norms: a decoder layer (a MoE one past the dense layers) and its projection
        ``eh_proj`` (2D -> D). Its embedding and output head are the main model's (not counted here)."""
        if self.is_moe_layer(self.num_hidden_layers):
            ffn = self.router_params() + self.shared_expert_params() + experts_per_layer * self.expert_params()
        else:
            ffn = self.dense_mlp_params()
        return self.attention_params() + ffn + 2 * self.hidden_size * self.hidden_size

    def total_params(self) -> int:
        return (self._params(self.n_routed_experts) + self.mtp_layers * self.mtp_layer_params(self.n_routed_experts)
                + self.norm_params() + self.embedding_params())

    def frozen_params(self) -> int:
        """Parameters outside ``total_params`` because they are never trained: the routers' correction biases."""
        mtp_moe = self.mtp_layers if self.is_moe_layer(self.num_hidden_layers) else 0
        return (self.num_moe_layers + mtp_moe) * self.n_routed_experts

    def active_params(self) -> int:
        """N: parameters touched per token, excluding the input embedding and all norms. Each MTP layer held adds
        its own and the shared output head once more (the head runs again at every depth)."""
        mtp = self.mtp_layer_params(self.num_experts_per_tok) + self.lm_head_params()
        return self._params(self.num_experts_per_tok) + self.mtp_layers * mtp

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(nope + rope), times mscale(factor, mscale_all_dim)² under a scaled RoPE that sets mscale_all_dim
        (DeepSeek's own correction of every dimension, on top of YaRN's cos/sin factor), as transformers applies it."""
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        if self.rope_scaling.kind != "default" and self.rope_scaling.mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim) ** 2
        return scale

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "DeepseekV3Config":
        model_type = raw.get("model_type")
        if model_type not in (None, MODEL_TYPE):
            raise ValueError(f"{source}: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        # rope_scaling: read below, as a RoPE placement; keep_mtp: no config.json key (a config read here holds the
        # MTP layers it declares)
        known = {f.name for f in fields(cls)} - {"rope_scaling", "keep_mtp"}
        check_other_keys(raw, handled=known | _DERIVED_KEYS | {"rope_theta", *ROPE_PLACEMENTS},
                         family="DeepSeek-V3", source=source, neutral=_NEUTRAL_HF_KEYS)
        kwargs: dict[str, Any] = {key: value for key, value in raw.items() if key in known}
        if kwargs.get("num_key_value_heads") is None and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # transformers' default
        if isinstance(kwargs.get("eos_token_id"), list):  # several stop tokens: the model reads none of them
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0] if kwargs["eos_token_id"] else None
        check_field_types(cls, kwargs, source=source)
        kwargs["rope_theta"], rope = read_rope(raw, source=source, default_theta=TRANSFORMERS_DEFAULT_THETA,
                                               rope_types=("default", *ROPE_SCALING_KEYS),
                                               extra_keys=frozenset().union(*ROPE_SCALING_KEYS.values()))
        for key in set(rope) - {"rope_type", "type", "rope_theta"}:
            kind = rope.get("rope_type", rope.get("type", "default"))
            if key not in ROPE_SCALING_KEYS.get(kind, ()):
                raise ValueError(f"{source}: rope_scaling.{key}={rope[key]!r} is not read by {kind} RoPE")
        kwargs["rope_scaling"] = RopeScaling.from_hf(
            rope, max_position_embeddings=kwargs.get("max_position_embeddings", 4096), source=source)
        kwargs["keep_mtp"] = kwargs.get("num_nextn_predict_layers", 0) > 0
        config = build_config(cls, kwargs, source=source)
        for key, value in (("qk_head_dim", config.qk_head_dim), ("head_dim", config.qk_rope_head_dim)):
            if raw.get(key) not in (None, value):
                raise ValueError(f"{source}: {key}={raw[key]!r} contradicts the head dims (expected {value})")
        if config.n_shared_experts == 0:  # transformers keeps a zero-width shared MLP whose tensors this model lacks
            raise ValueError(f"{source}: n_shared_experts=0 is not supported for a Hugging Face checkpoint "
                             "(transformers builds a zero-width shared expert); give 1 or more")
        return config

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "DeepseekV3Config":
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json of this model: it declares the MTP layers it holds (an export writes their tensors)."""
        out = asdict(self)
        del out["keep_mtp"]
        out["num_nextn_predict_layers"] = self.mtp_layers
        out.update(architectures=["DeepseekV3ForCausalLM"], model_type=MODEL_TYPE,
                   rope_scaling=self.rope_scaling.to_hf(),
                   attention_dropout=0.0, use_cache=True,
                   qk_head_dim=self.qk_head_dim, head_dim=self.qk_rope_head_dim)
        return out
