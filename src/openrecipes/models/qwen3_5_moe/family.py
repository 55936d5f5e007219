"""Qwen3.5-MoE's declaration: named configs, HF mapping, planner shape, chat format and sharding plan.

The planner's shape describes the full-attention layers' q/k/v widths and, per layer, which layers are linear
attention: their token mixing is reckoned as the chunked delta rule's FLOPs per token (constant in the row length;
delta_rule.chunked_flops_per_token), the full-attention layers' as softmax attention. Parameters are counted exactly
(``attention_params`` below is the per-layer mean of both kinds of mixer); the activations of a linear-attention
layer are reckoned as a full-attention layer's (approximate, docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from openrecipes.models.families import ModelFamily, RouterAuxLoss, ShardingPlan
from openrecipes.models.qwen3_5_moe import hf
from openrecipes.models.qwen3_5_moe.config import MODEL_TYPE, Qwen35MoeConfig
from openrecipes.models.qwen3_5_moe.delta_rule import chunked_flops_per_token
from openrecipes.models.qwen3_5_moe.model import Qwen35MoeForCausalLM, build_qwen3_5_moe
from openrecipes.models.shape import AttentionWidths, ModelShape


@dataclass(frozen=True, kw_only=True)
class HybridShardingPlan(ShardingPlan):
    """``attention_of`` gives a layer's token mixer: ``self_attn`` in a full-attention layer, ``linear_attn``
    (which refuses tensor and context parallelism by name, model.py) in a linear-attention layer."""

    linear_attention: str = "linear_attn"

    def attention_of(self, layer: nn.Module) -> nn.Module:
        return layer.get_submodule(self.attention if layer.full_attention else self.linear_attention)


def planner_shape(config: Qwen35MoeConfig, name: str) -> ModelShape:
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layers = config.num_hidden_layers
    mean_norms = (config.norm_params() - config.hidden_size) // layers
    return ModelShape(
        name=name or "qwen3.5-moe", num_layers=layers, hidden=config.hidden_size,
        vocab=config.vocab_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        attention_widths=AttentionWidths(query=heads * head_dim, key=kv_heads * head_dim, value=kv_heads * head_dim),
        attention_output_gate=True, attention_output_norm=False, residual_gates=False,
        attention_windows=(None,) * layers, moe_layers=None,
        num_experts=config.num_experts, top_k=config.num_experts_per_tok, expert_in=config.hidden_size,
        expert_ffn=config.moe_intermediate_size, latent=0, router_fp32=False,
        # per layer, the mean over both mixers, so that layers x this is every mixer's parameters (approximate time)
        attention_params=config.mixer_params() // layers, latent_params=0,
        router_params=config.router_params(), expert_params=config.expert_params(),
        shared_expert_params=config.shared_expert_params(), small_params_per_layer=mean_norms,
        embedding_params=config.embedding_params(), lm_head_params=config.lm_head_params(),
        active_params=config.active_params(),
        linear_attention_layers=tuple(not config.is_full_attention(i) for i in range(layers)),
        linear_attention_flops_per_token=chunked_flops_per_token(
            config.linear_key_head_dim, config.linear_value_head_dim, config.linear_num_value_heads),
    )


NAMED_CONFIGS = {
    # CPU-sized, with the bundled tokenizer's vocabulary: 3 linear-attention layers then 1 full-attention layer
    # (transformers' default pattern), 8 routed experts (2 per token) and a shared expert, linear attention with
    # 2 query/key heads shared by 4 value heads, GQA 4/2 heads of 16 with a quarter rotated
    "qwen3.5-moe-tiny": lambda: Qwen35MoeConfig(
        vocab_size=1024, hidden_size=64, num_hidden_layers=4,
        layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096,
    ),
    # Qwen/Qwen3.5-35B-A3B's text model: transformers 5.x documents its Qwen3_5MoeTextConfig defaults as this
    # checkpoint's (hidden 2048, 40 layers with every fourth full attention, 16/2 heads of 256, a quarter rotated,
    # linear attention 16 query/key and 32 value heads of 128, 256 experts of 512 with top-8, a shared expert of 512,
    # vocabulary 248,320); the RoPE base 10,000,000 and the 262,144-token context are the published model's (its
    # Megatron training scripts and model listings), not transformers' defaults
    "qwen3.5-35b-a3b": lambda: Qwen35MoeConfig(
        vocab_size=248_320, hidden_size=2048, num_hidden_layers=40,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 10, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
        max_position_embeddings=262_144,
    ),
}

FAMILY = ModelFamily(
    name="qwen3_5_moe", named_configs=NAMED_CONFIGS, model_class=Qwen35MoeForCausalLM, planner_shape=planner_shape,
    chat_format="qwen3",
    sharding=HybridShardingPlan(
        layers="model.layers", embedding="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
        attention="self_attn", moe="mlp",
        attention_tp={"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"},
        experts={"gate_proj": 1, "up_proj": 1, "down_proj": 2},
        # the linear-attention layers run whole (their tensor parallelism is refused); shared experts replicated
        replicated=("embed_tokens", "norm", "layernorm", "linear_attn", "mlp.gate", "shared_expert", "lm_head"),
    ),
    model_types=(MODEL_TYPE,), config_class=Qwen35MoeConfig,
    config_from_hf=lambda raw, source: Qwen35MoeConfig.from_hf_dict(raw, source=source),
    config_to_hf=lambda config: config.to_hf_dict(), build=build_qwen3_5_moe,
    native_parts=hf.native_parts, to_hf=hf.to_hf, ignored_key=hf.ignored_key,
    aux_loss=RouterAuxLoss(),  # output_router_logits and router_aux_loss_coef, as transformers' forward reads them
    not_split=tuple((field, f"Qwen3.5-MoE's linear-attention layers (Gated DeltaNet) run whole on one process: {what} "
                            "is not supported for them") for field, what in (("tp", "tensor parallelism"),
                                                                            ("cp", "context parallelism"))),
)
