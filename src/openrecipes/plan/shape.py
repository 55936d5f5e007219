"""The model shape the planner works on, computed from each model family's config.

Every size the memory and throughput models need lives here, so they never look at a family's
config class. ``expert_in`` is the width experts read and write: the hidden size for Qwen3-MoE, the
latent width for Muse Spark (whose experts sit between a down and an up projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    attention_output_gate: bool
    attention_output_norm: bool
    residual_gates: bool
    # per layer: None = full causal attention, else the sliding window in tokens
    attention_windows: tuple[int | None, ...]
    num_experts: int
    top_k: int
    expert_in: int
    expert_ffn: int
    latent: int  # 0: experts read the hidden state directly
    router_fp32: bool
    # parameter counts
    attention_params: int  # per layer, split by TP (q, k, v, o, output gate)
    latent_params: int  # per layer, split by TP (down + up projections)
    router_params: int  # per layer, replicated on TP ranks
    expert_params: int  # one expert
    small_params_per_layer: int  # norms and residual gates, replicated
    embedding_params: int
    lm_head_params: int
    active_params: int  # N of DESIGN.md

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def dense_layer_matmul_params(self) -> int:
        return self.attention_params + self.latent_params + self.router_params


def model_shape(config: Any, *, name: str = "") -> ModelShape:
    """Adapter: Qwen3MoeConfig or MuseSparkConfig -> ModelShape."""
    from openrecipes.models.muse_spark.config import FULL, MuseSparkConfig
    from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig

    if isinstance(config, Qwen3MoeConfig):
        per_layer_norms = 2 * config.hidden_size + 2 * config.head_dim
        return ModelShape(
            name=name or "qwen3-moe", num_layers=config.num_hidden_layers, hidden=config.hidden_size,
            vocab=config.vocab_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, attention_output_gate=False, attention_output_norm=False,
            residual_gates=False, attention_windows=(None,) * config.num_hidden_layers,
            num_experts=config.num_experts, top_k=config.num_experts_per_tok, expert_in=config.hidden_size,
            expert_ffn=config.moe_intermediate_size, latent=0, router_fp32=False,
            attention_params=config.attention_params(), latent_params=0, router_params=config.router_params(),
            expert_params=config.expert_params(), small_params_per_layer=per_layer_norms,
            embedding_params=config.embedding_params(), lm_head_params=config.lm_head_params(),
            active_params=config.active_params(),
        )
    if isinstance(config, MuseSparkConfig):
        windows = tuple(None if t == FULL else config.sliding_window for t in config.layer_types)
        small = (config.norm_params() - config.hidden_size) // config.num_hidden_layers
        small += config.residual_gates_per_layer * config.hidden_size
        return ModelShape(
            name=name or "muse-spark", num_layers=config.num_hidden_layers, hidden=config.hidden_size,
            vocab=config.vocab_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, attention_output_gate=config.attention_output_gate,
            attention_output_norm=True, residual_gates=config.residual_gates_per_layer > 0,
            attention_windows=windows, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
            expert_in=config.moe_latent_size, expert_ffn=config.moe_intermediate_size,
            latent=config.moe_latent_size, router_fp32=config.router_dtype == "float32",
            attention_params=config.attention_params(), latent_params=config.latent_projection_params(),
            router_params=config.router_params(), expert_params=config.expert_params(),
            small_params_per_layer=small, embedding_params=config.embedding_params(),
            lm_head_params=config.lm_head_params(), active_params=config.active_params(),
        )
    raise ValueError(f"model: the planner does not know config type {type(config).__name__}")
