"""GLM-4.5-MoE's declaration: named configs, HF mapping, planner shape, chat format and sharding plan."""

from __future__ import annotations

from openrecipes.models.families import ModelFamily, ShardingPlan
from openrecipes.models.glm4_moe import hf
from openrecipes.models.glm4_moe.config import MODEL_TYPE, Glm4MoeConfig
from openrecipes.models.glm4_moe.model import Glm4MoeForCausalLM, build_glm4_moe
from openrecipes.models.shape import AttentionWidths, ModelShape


def planner_shape(config: Glm4MoeConfig, name: str) -> ModelShape:
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return ModelShape(
        name=name or "glm4-moe", num_layers=config.num_hidden_layers, hidden=config.hidden_size,
        vocab=config.vocab_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        attention_widths=AttentionWidths(query=heads * head_dim, key=kv_heads * head_dim, value=kv_heads * head_dim),
        attention_output_gate=False, attention_output_norm=False, residual_gates=False,
        attention_windows=(None,) * config.num_hidden_layers,
        moe_layers=tuple(config.is_moe_layer(i) for i in range(config.num_hidden_layers)),
        num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok, expert_in=config.hidden_size,
        expert_ffn=config.moe_intermediate_size, latent=0, router_fp32=True,
        attention_params=config.attention_params(), latent_params=0,
        router_params=config.router_params(), expert_params=config.expert_params(),
        shared_expert_params=config.shared_expert_params(), dense_mlp_params=config.dense_mlp_params(),
        small_params_per_layer=config.norm_params_per_layer(),
        embedding_params=config.embedding_params(), lm_head_params=config.lm_head_params(),
        active_params=config.active_params(),
    )


NAMED_CONFIGS = {
    # zai-org/GLM-4.5-Air config.json (transformers 4.54.1's dump of it), field by field; its one MTP layer is
    # declared and skipped on import
    "glm-4.5-air": lambda: Glm4MoeConfig(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
        n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, attention_bias=True,
        partial_rotary_factor=0.5, rms_norm_eps=1e-5, rope_theta=1_000_000.0, max_position_embeddings=131072,
        num_nextn_predict_layers=1, pad_token_id=151329, eos_token_id=151329,
    ),
    # CPU-sized, with the bundled tokenizer's vocabulary: a dense first layer, 8 routed experts in 2 groups, one
    # shared expert, GQA with biases and qk-norm, half of each head rotated, heads * head_dim != hidden
    "glm4-moe-tiny": lambda: Glm4MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, max_position_embeddings=4096,
    ),
}

FAMILY = ModelFamily(
    name="glm4_moe", named_configs=NAMED_CONFIGS, model_class=Glm4MoeForCausalLM, planner_shape=planner_shape,
    chat_format="qwen3",  # no GLM template is built in; the bundled data and tokenizer use this one
    sharding=ShardingPlan(
        layers="model.layers", embedding="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
        attention="self_attn", moe="mlp", dense_layer=lambda layer: layer.dense,
        # q/k/v split by heads (their biases with them), o_proj by its input; the per-head q/k norms stay whole
        attention_tp={"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"},
        experts={"gate_proj": 1, "up_proj": 1, "down_proj": 2},
        replicated=("embed_tokens", "norm", "layernorm", "mlp.gate", "mlp.up_proj", "mlp.down_proj",
                    "shared_experts", "lm_head"),
    ),
    model_types=(MODEL_TYPE,), config_class=Glm4MoeConfig,
    config_from_hf=lambda raw, source: Glm4MoeConfig.from_hf_dict(raw, source=source),
    config_to_hf=lambda config: config.to_hf_dict(), build=build_glm4_moe,
    native_parts=hf.native_parts, to_hf=hf.to_hf, ignored_key=hf.ignored_key,
)
