"""The model shape the planner works on: every size its memory and throughput models need, so they never look at
a family's config class. Each family's declaration (``ModelFamily.planner_shape``) computes it from its config.

``expert_in`` is the width experts read and write: the hidden size for Qwen3-MoE, the latent width for Muse Spark
(whose experts sit between a down and an up projection).
"""

from __future__ import annotations

from dataclasses import dataclass

from openrecipes.config.layout import LayoutModel


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
    latent_params: int  # per layer (down + up projections), whole on every TP rank
    router_params: int  # per layer, replicated on TP ranks
    expert_params: int  # one expert
    small_params_per_layer: int  # norms and residual gates, replicated
    embedding_params: int
    lm_head_params: int
    active_params: int  # N of DESIGN.md
    # other-modality encoders (vision, audio) that a trainer instantiating the whole published model holds frozen on
    # the first pipeline stage: bf16 parameters without gradients or optimizer state; 0 where there are none
    frozen_encoder_params: int = 0
    # the part of frozen_encoder_params that projects the encoders' features into the decoder, which this engine
    # trains unless the recipe freezes it (vision.train_projection); the rest (the towers) never trains here
    encoder_projection_params: int = 0

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layout_model(self) -> LayoutModel:
        """The sizes the layout rules check (config/layout.py ``layout_problems``)."""
        return LayoutModel(num_layers=self.num_layers, num_experts=self.num_experts, heads=self.heads,
                           kv_heads=self.kv_heads, expert_ffn=self.expert_ffn)

    def dense_layer_matmul_params(self) -> int:
        return self.attention_params + self.latent_params + self.router_params
