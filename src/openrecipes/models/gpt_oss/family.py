"""gpt-oss's declaration: named configs, HF mapping, planner shape, chat format and sharding plan."""

from __future__ import annotations

from openrecipes.models.families import ModelFamily, ShardingPlan
from openrecipes.models.gpt_oss import hf
from openrecipes.models.gpt_oss.config import MODEL_TYPE, GptOssConfig
from openrecipes.models.gpt_oss.model import GptOssForCausalLM, build_gpt_oss
from openrecipes.models.shape import ModelShape


def planner_shape(config: GptOssConfig, name: str) -> ModelShape:
    return ModelShape(
        name=name or "gpt-oss", num_layers=config.num_hidden_layers, hidden=config.hidden_size,
        vocab=config.vocab_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, attention_output_gate=False, attention_output_norm=False,
        residual_gates=False, attention_windows=tuple(config.window(i) for i in range(config.num_hidden_layers)),
        num_experts=config.num_local_experts, top_k=config.num_experts_per_tok, expert_in=config.hidden_size,
        expert_ffn=config.intermediate_size, latent=0, router_fp32=False,
        attention_params=config.attention_params(), latent_params=0, router_params=config.router_params(),
        expert_params=config.expert_params(), small_params_per_layer=2 * config.hidden_size,
        embedding_params=config.embedding_params(), lm_head_params=config.lm_head_params(),
        active_params=config.active_params(), attention_sinks=True,
    )


def _published(layers: int, experts: int) -> GptOssConfig:
    """openai/gpt-oss-20b and -120b config.json, field by field (they differ in layers and experts only); the
    YaRN RoPE and layer_types (sliding, full alternating) are GptOssConfig's defaults, which equal theirs."""
    return GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=experts,
        num_experts_per_tok=4, sliding_window=128, rms_norm_eps=1e-5, rope_theta=150000.0,
        max_position_embeddings=131072, swiglu_limit=7.0, attention_bias=True, initializer_range=0.02,
        eos_token_id=200002, pad_token_id=199999,
    )


NAMED_CONFIGS = {
    # openai/gpt-oss-20b config.json: 24 layers, 32 experts (router_aux_loss_coef 0.9 is unread: no aux loss)
    "gpt-oss-20b": lambda: _published(24, 32),
    # https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json: 36 layers, 128 experts
    "gpt-oss-120b": lambda: _published(36, 128),
    # CPU tests and the demo: sliding and full layers, a window shorter than the test rows
    "gpt-oss-tiny": lambda: GptOssConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=4096, rms_norm_eps=1e-5,
    ),
}

FAMILY = ModelFamily(
    name="gpt_oss", named_configs=NAMED_CONFIGS, model_class=GptOssForCausalLM, planner_shape=planner_shape,
    chat_format="qwen3",  # no harmony template is built in; the bundled data and tokenizer use this one
    sharding=ShardingPlan(
        layers="model.layers", embedding="model.embed_tokens", final_norm="model.norm", lm_head="lm_head",
        attention="self_attn", moe="mlp",
        # declared for the contract; the attention refuses tensor parallelism (its sinks are not split by head)
        attention_tp={"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"},
        experts={"gate_proj": 1, "up_proj": 1, "down_proj": 2},
        replicated=("embed_tokens", "norm", "layernorm", "sinks", "mlp.router", "lm_head"),
    ),
    model_types=(MODEL_TYPE,), config_class=GptOssConfig,
    config_from_hf=lambda raw, source: GptOssConfig.from_hf_dict(raw, source=source),
    config_to_hf=lambda config: config.to_hf_dict(), build=build_gpt_oss,
    native_parts=hf.native_parts, to_hf=hf.to_hf,
    not_split=(
        ("ep", "gpt-oss's experts run on one process (the parallel dispatchers run neither its expert biases nor "
               "its clamped SwiGLU): expert parallelism is not supported"),
        ("etp", "gpt-oss's experts run on one process (the parallel dispatchers run neither its expert biases nor "
                "its clamped SwiGLU): expert tensor parallelism is not supported"),
        ("tp", "gpt-oss's attention does not split over heads (the row-parallel o_proj's bias, the per-head sinks): "
               "tensor parallelism is not supported"),
        ("cp", "gpt-oss's attention sinks run in one kernel over the whole row: context parallelism is not supported"),
    ),
)
