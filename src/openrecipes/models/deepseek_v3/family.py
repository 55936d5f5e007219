"""DeepSeek-V3's declaration: named configs, HF mapping, planner shape, chat format and sharding plan."""

from __future__ import annotations

from openrecipes.models.common.rope_scaling import RopeScaling
from openrecipes.models.deepseek_v3 import hf
from openrecipes.models.deepseek_v3.config import MODEL_TYPE, DeepseekV3Config
from openrecipes.models.deepseek_v3.model import DeepseekV3ForCausalLM, build_deepseek_v3
from openrecipes.models.families import ModelFamily, MultiTokenPrediction, ShardingPlan
from openrecipes.models.shape import AttentionWidths, ModelShape


def planner_shape(config: DeepseekV3Config, name: str) -> ModelShape:
    heads = config.num_attention_heads
    latent_norms = config.kv_lora_rank + (config.q_lora_rank or 0)
    return ModelShape(
        name=name or "deepseek-v3", num_layers=config.num_hidden_layers, hidden=config.hidden_size,
        vocab=config.vocab_size, heads=heads, kv_heads=heads, head_dim=config.qk_head_dim,
        attention_widths=AttentionWidths(
            query=heads * config.qk_head_dim, key=heads * config.qk_head_dim, value=heads * config.v_head_dim,
            latent=(config.q_lora_rank or 0) + config.kv_lora_rank + config.qk_rope_head_dim),
        attention_output_gate=False, attention_output_norm=False, residual_gates=False,
        attention_windows=(None,) * config.num_hidden_layers,
        moe_layers=tuple(config.is_moe_layer(i) for i in range(config.num_hidden_layers)),
        num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok, expert_in=config.hidden_size,
        expert_ffn=config.moe_intermediate_size, latent=0, router_fp32=True,
        attention_params=config.attention_head_params(), latent_params=config.attention_latent_params(),
        router_params=config.router_params(), expert_params=config.expert_params(),
        shared_expert_params=config.shared_expert_params(), dense_mlp_params=config.dense_mlp_params(),
        small_params_per_layer=2 * config.hidden_size + latent_norms,
        embedding_params=config.embedding_params(), lm_head_params=config.lm_head_params(),
        active_params=config.active_params(),
        mtp_layers=config.mtp_layers, mtp_params=2 * config.hidden_size ** 2 + 3 * config.hidden_size,
    )


NAMED_CONFIGS = {
    # deepseek-ai/DeepSeek-V3 config.json: its sizes and its YaRN (factor 40 over 4,096 trained positions)
    "deepseek-v3-671b": lambda: DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10_000.0,
        max_position_embeddings=163840, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=1,
        rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    ),
    # CPU-sized, with the bundled tokenizer's vocabulary: a dense first layer, 8 routed experts in 2 groups, one
    # shared expert, a value head width unlike the query/key one
    "deepseek-v3-tiny": lambda: DeepseekV3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
        max_position_embeddings=4096,
    ),
}

FAMILY = ModelFamily(
    name="deepseek_v3", named_configs=NAMED_CONFIGS, model_class=DeepseekV3ForCausalLM, planner_shape=planner_shape,
    chat_format="qwen3",  # no DeepSeek template is built in; the bundled data and tokenizer use this one
    sharding=ShardingPlan(
        layers="model.layers", embedding="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
        attention="self_attn", moe="mlp", dense_layer=lambda layer: layer.dense, extra_layers="model.mtp_layers",
        # the head projections split by heads; the latent ones (q_a, kv_a and their norms) stay whole, their
        # gradients (partial over the heads) summed over TP like every replicated weight's
        attention_tp={"q_proj": "colwise", "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"},
        experts={"gate_proj": 1, "up_proj": 1, "down_proj": 2},
        replicated=("embed_tokens", "norm", "layernorm", "q_a_proj", "kv_a_proj_with_mqa", "mlp.gate",
                    "mlp.up_proj", "mlp.down_proj", "shared_experts", "lm_head"),
    ),
    model_types=(MODEL_TYPE,), config_class=DeepseekV3Config,
    config_from_hf=lambda raw, source: DeepseekV3Config.from_hf_dict(raw, source=source),
    config_to_hf=lambda config: config.to_hf_dict(), build=build_deepseek_v3,
    native_parts=hf.native_parts, to_hf=hf.to_hf, ignored_key=hf.ignored_key,
    mtp=MultiTokenPrediction(held=lambda config: config.mtp_layers, keep=hf.with_mtp_kept,
                             native_parts=hf.mtp_native_parts),
)
