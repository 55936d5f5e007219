"""Qwen3-MoE's declaration: named configs, HF mapping, planner shape, chat format and sharding plan."""

from __future__ import annotations

from openrecipes.models.families import ModelFamily, RouterAuxLoss, ShardingPlan
from openrecipes.models.qwen3_moe import hf
from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig
from openrecipes.models.qwen3_moe.model import Qwen3MoeForCausalLM, build_qwen3_moe
from openrecipes.models.shape import ModelShape


def planner_shape(config: Qwen3MoeConfig, name: str) -> ModelShape:
    per_layer_norms = 2 * config.hidden_size + 2 * config.head_dim
    return ModelShape(
        name=name or "qwen3-moe", num_layers=config.num_hidden_layers, hidden=config.hidden_size,
        vocab=config.vocab_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, attention_output_gate=False, attention_output_norm=False,
        residual_gates=False, attention_windows=(config.sliding_window,) * config.num_hidden_layers,
        moe_layers=tuple(config.is_moe_layer(i) for i in range(config.num_hidden_layers)),
        dense_mlp_params=config.dense_mlp_params(), num_experts=config.num_experts,
        top_k=config.num_experts_per_tok, expert_in=config.hidden_size,
        expert_ffn=config.moe_intermediate_size, latent=0, router_fp32=False,
        attention_params=config.attention_params(), latent_params=0, router_params=config.router_params(),
        expert_params=config.expert_params(), small_params_per_layer=per_layer_norms,
        embedding_params=config.embedding_params(), lm_head_params=config.lm_head_params(),
        active_params=config.active_params(),
    )


NAMED_CONFIGS = {
    # Qwen/Qwen3-30B-A3B config.json (revision ad44e777bcd18fa416d9da3bd8f70d33ebb85d39), field by field.
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    # Small enough for CPU tests and the demo; num_attention_heads * head_dim != hidden_size on purpose.
    "qwen3-moe-tiny": lambda: Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=10_000.0, max_position_embeddings=4096,
    ),
}

FAMILY = ModelFamily(
    name="qwen3_moe", named_configs=NAMED_CONFIGS, model_class=Qwen3MoeForCausalLM, planner_shape=planner_shape,
    chat_format="qwen3",
    sharding=ShardingPlan(
        layers="model.layers", embedding="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
        attention="self_attn", moe="mlp", dense_layer=lambda layer: layer.dense,
        attention_tp={"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"},
        experts={"gate_proj": 1, "up_proj": 1, "down_proj": 2},
        # "mlp.gate" also names the dense layers' mlp.gate_proj: whole on every TP rank, like DeepSeek-V3's
        replicated=("embed_tokens", "norm", "layernorm", "mlp.gate", "mlp.up_proj", "mlp.down_proj", "lm_head"),
    ),
    model_types=("qwen3_moe",), config_class=Qwen3MoeConfig,
    config_from_hf=lambda raw, source: Qwen3MoeConfig.from_hf_dict(raw, source=source),
    config_to_hf=lambda config: config.to_hf_dict(), build=build_qwen3_moe,
    native_parts=hf.native_parts, to_hf=hf.to_hf,
    aux_loss=RouterAuxLoss(),  # Qwen3MoeConfig's output_router_logits and router_aux_loss_coef, as transformers'
)
