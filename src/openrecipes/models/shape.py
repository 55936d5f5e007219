"""The model shape the planner works on: every size its memory and throughput models need, so they never look at
a family's config class. Each family's declaration (``ModelFamily.planner_shape``) computes it from its config.

``expert_in`` is the width experts read and write: the hidden size for Qwen3-MoE, the latent width for Muse Spark
(whose experts sit between a down and an up projection).

Layers are MoE layers unless ``moe_layers`` says otherwise (DeepSeek-V3's first layers hold a dense MLP of
``dense_mlp_params``); a MoE layer may hold shared experts every token takes (``shared_expert_params``). Attention is
described by its per-token widths (``AttentionWidths``), which need not be heads x head_dim for q, k and v alike
(latent attention: keys wider than values, compressed latents before the head projections).
"""

from __future__ import annotations

from dataclasses import dataclass

from openrecipes.config.layout import LayoutModel


def mean_context(seq_len: float, window: int | None) -> float:
    """Average number of keys a query attends to in a causal sequence of ``seq_len`` tokens."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return window - window * (window - 1) / (2 * seq_len)


@dataclass(kw_only=True, frozen=True)
class AttentionWidths:
    """Per-token widths of one attention layer, summed over its heads."""

    query: int       # queries (and each head's score width)
    key: int         # keys as the attention kernel reads them
    value: int       # values, and the output projection's input
    latent: int = 0  # compressed widths the head projections read (MLA: q_lora_rank + kv_lora_rank + the rope key)


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
    active_params: int  # N: active parameters per token, without the input embedding and all norms (docs/measure.md)
    # other-modality encoders (vision, audio) that a trainer instantiating the whole published model holds frozen on
    # the first pipeline stage: bf16 parameters without gradients or optimizer state; 0 where there are none
    frozen_encoder_params: int = 0
    # the part of frozen_encoder_params that projects the encoders' features into the decoder, which this engine
    # trains unless the recipe freezes it (vision.train_projection); the rest (the towers) never trains here
    encoder_projection_params: int = 0
    # None: q, k and v each heads (kv_heads) x head_dim wide
    attention_widths: AttentionWidths | None = None
    # per layer: True = a MoE block, False = a dense MLP; None = every layer a MoE layer
    moe_layers: tuple[bool, ...] | None = None
    dense_mlp_params: int = 0       # one dense layer's MLP
    shared_expert_params: int = 0   # per MoE layer, the shared experts (dense, replicated on TP ranks)
    # multi-token-prediction layers trained beside the last stage's layers (DeepSeek-V3, recipe ``mtp``): each a MoE
    # layer plus ``mtp_params`` of its own (its 2D -> D projection and norms), reading the shared embedding and
    # running the shared LM head once more
    mtp_layers: int = 0
    mtp_params: int = 0
    # per layer: True = linear attention (Qwen3.5-MoE's Gated DeltaNet), whose token mixing costs
    # ``linear_attention_flops_per_token`` forward FLOPs per token whatever the row length; None = none
    linear_attention_layers: tuple[bool, ...] | None = None
    linear_attention_flops_per_token: int = 0
    # per-head sink logits in every softmax (gpt-oss): this engine's SDPA path passes them as a (rows, heads, T, T+1)
    # float mask, which the kernel keeps for the backward (models/common/attention.py); its flex path makes none
    attention_sinks: bool = False
    # the registered family (models/registry.py) whose measured speed calibrates the planner's compute for it
    # (planner.yaml openrecipes_engine.family_compute_scale); "" where none is known
    family: str = ""

    @property
    def widths(self) -> AttentionWidths:
        if self.attention_widths is not None:
            return self.attention_widths
        kv = self.kv_heads * self.head_dim
        return AttentionWidths(query=self.heads * self.head_dim, key=kv, value=kv)

    @property
    def q_width(self) -> int:
        return self.widths.query

    @property
    def kv_width(self) -> int:
        """The mean of the key and value widths, so that 2 x kv_width is what keys and values hold together."""
        return (self.widths.key + self.widths.value) // 2

    def attention_flops(self, layer: int, tokens: float, seq_len: float) -> float:
        """Forward FLOPs of one layer's token mixing (the projections are matmul parameters) for ``tokens`` tokens of
        rows ``seq_len`` long: softmax attention's q.k and p.v over the mean causal context, or linear attention's."""
        if self.linear_attention_layers is not None and self.linear_attention_layers[layer]:
            return tokens * self.linear_attention_flops_per_token
        return 4 * tokens * self.q_width * mean_context(seq_len, self.attention_windows[layer])

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers if self.moe_layers is None else sum(self.moe_layers)

    def layout_model(self) -> LayoutModel:
        """The sizes the layout rules check (config/layout.py ``layout_problems``), and the dimensions the
        registered family does not split."""
        from openrecipes.models.registry import families  # the families declare their shapes: imported on use

        not_split = next((f.not_split for f in families() if f.name == self.family), ())
        return LayoutModel(num_layers=self.num_layers, num_experts=self.num_experts, heads=self.heads,
                           kv_heads=self.kv_heads, expert_ffn=self.expert_ffn, not_split=not_split)

    @property
    def moe_layer_fraction(self) -> float:
        """The share of layers holding routed experts: per-layer expert figures are multiplied by it."""
        return self.num_moe_layers / self.num_layers

    def feed_forward_dense_params(self) -> float:
        """Parameters of a layer's feed-forward block outside its routed experts, averaged over the layers (a dense
        layer holds its MLP, a MoE layer its router and shared experts); whole on every TP rank."""
        moe = self.num_moe_layers
        return (moe * (self.router_params + self.shared_expert_params)
                + (self.num_layers - moe) * self.dense_mlp_params) / self.num_layers

    def mtp_layer_dense_params(self) -> int:
        """One MTP layer's parameters outside its routed experts (a MoE layer's: attention, latent projections,
        router, shared experts, norms; and its own)."""
        return (self.attention_params + self.latent_params + self.router_params + self.shared_expert_params
                + self.small_params_per_layer + self.mtp_params)

    def dense_layer_matmul_params(self) -> float:
        """Matmul parameters of a layer outside its routed experts, averaged over the layers."""
        return self.attention_params + self.latent_params + self.feed_forward_dense_params()
