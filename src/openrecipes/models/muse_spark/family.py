"""Muse Spark's declaration: named configs, HF mapping, planner shape, chat format and sharding plan."""

from __future__ import annotations

from dataclasses import replace

from openrecipes.models.families import ImageInputs, ModelFamily, ShardingPlan
from openrecipes.models.muse_spark import hf
from openrecipes.models.muse_spark.config import FULL, MODEL_TYPE, MuseSparkConfig
from openrecipes.models.muse_spark.model import MuseSparkForCausalLM, build_muse_spark
from openrecipes.models.muse_spark.tower_config import MuseSparkAudioConfig, MuseSparkVisionConfig
from openrecipes.models.shape import ModelShape


# Every tensor of the published checkpoint, towers included (seed 001's export comparison: 822,036,529,664 elements);
# what the text model does not hold is the vision and audio towers with their adapters, which Megatron-Bridge
# instantiates and freezes in text-only training (here text-only mode does not load them; full-checkpoint mode does).
PUBLISHED_CHECKPOINT_ELEMENTS = 822_036_529_664


def planner_shape(config: MuseSparkConfig, name: str) -> ModelShape:
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
        frozen_encoder_params=_encoder_params(config),
        encoder_projection_params=config.vision.projection_params(config.hidden_size) if config.vision else 0,
    )


def _encoder_params(config: MuseSparkConfig) -> int:
    """The towers' parameters: the config's own where it has towers; for the text-only published config, what the
    published checkpoint holds beyond the text model (Megatron-Bridge instantiates and freezes the towers even in
    text-only training)."""
    if config.vision is not None or config.audio is not None:
        return config.tower_params()
    if config == NAMED_CONFIGS["muse-spark-open-816b-a42b"]():
        return PUBLISHED_CHECKPOINT_ELEMENTS - config.total_params()
    return 0


NAMED_CONFIGS = {
    # Muse Spark Open: the published architecture, with the sizes derived from it (docs/muse_spark.md).
    "muse-spark-open-816b-a42b": lambda: MuseSparkConfig(),
    # CPU-sized Muse Spark: mixed layer types (layers 1 and 3 full), latent experts, small window.
    "muse-spark-tiny": lambda: MuseSparkConfig(
        vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=16, moe_latent_size=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, max_position_embeddings=4096,
        layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
    ),
    # CPU-sized complete checkpoint: a small decoder with every tower (vision, its adapter and projection, audio).
    "muse-spark-tiny-full": lambda: MuseSparkConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, sliding_window=16, moe_latent_size=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, max_position_embeddings=4096, layer_types=("sliding_attention", "full_attention"),
        vision=MuseSparkVisionConfig(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                                     max_patches_per_side=16, out_hidden_size=24),
        audio=MuseSparkAudioConfig(conv_dim=(8, 8), conv_kernel=(5, 3), conv_stride=(4, 2), depth=2,
                                   hidden_size=16, intermediate_size=32, num_heads=2),
        image_token_id=250, video_token_id=251, audio_token_id=252,
    ),
    # The same towers and decoder with the vocabulary of the bundled Muse Spark image-text tokenizer (the bundled
    # 1,024 tokens, then <|image_start|>, <|image_end|>, <|image|>, <|video|>, <|audio|>:
    # data/assets/image_text/make_image_text.py), so it trains on the bundled image-text set.
    "muse-spark-tiny-vl": lambda: replace(NAMED_CONFIGS["muse-spark-tiny-full"](), vocab_size=1029,
                                          image_token_id=1026, video_token_id=1027, audio_token_id=1028),
}

# What of the complete model trains on image rows: the vision tower's encoder and the whole audio side are frozen
# towers (audio training is out of scope, as in the published recipes); the vision adapter and the projection into the
# decoder are the projection (``vision.train_projection``).
_VISION_TOWER = ("model.vision_tower.patch_embed", "model.vision_tower.position_embedding",
                 "model.vision_tower.blocks", "model.vision_tower.post_layernorm")
_AUDIO_TOWER = ("model.audio_tower", "model.audio_projector")
IMAGES = ImageInputs(
    towers=_VISION_TOWER + _AUDIO_TOWER,
    projection=("model.vision_tower.adapter", "model.multi_modal_projector"),
    image_token_id=lambda config: config.image_token_id,
    patch_geometry=lambda config: (config.vision.patch_size, config.vision.temporal_patch_size,
                                   config.vision.spatial_merge_size),
    # media tokens count up like text (1-D RoPE): the rows' per-document positions, as one axis
    positions=lambda config, input_ids, position_ids, grid, held: position_ids[None],
    first_stage_layers=lambda config: 0,  # the features enter at the embedding
    holds=lambda config, path: (config.audio if path in _AUDIO_TOWER else config.vision) is not None,
)

FAMILY = ModelFamily(
    name="muse_spark", named_configs=NAMED_CONFIGS, model_class=MuseSparkForCausalLM, planner_shape=planner_shape,
    chat_format="muse_spark",
    sharding=ShardingPlan(
        layers="model.language_model.layers", embedding="model.language_model.embed_tokens",
        final_norm="model.language_model.norm", lm_head="lm_head", attention="self_attn", moe="mlp",
        # per-head work (Q/K norms, the output norm and sigmoid output gate) follows the heads' split
        attention_tp={"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "output_gate_proj": "colwise",
                      "o_proj": "rowwise"},
        experts={"gate_proj": 1, "up_proj": 1, "down_proj": 2},
        replicated=("embed_tokens", "norm", "layernorm", "residual_gate", "mlp.gate", "latent_down_proj",
                    "latent_up_proj", "lm_head", *hf.TOWER_PREFIXES),
    ),
    model_types=(MODEL_TYPE,), config_class=MuseSparkConfig,
    config_from_hf=lambda raw, source: MuseSparkConfig.from_hf_dict(raw, source=source),
    config_to_hf=lambda config: config.to_hf_dict(), build=build_muse_spark,
    native_parts=hf.native_parts, to_hf=hf.to_hf, ignored_key=hf.ignored_key, text_only=hf.text_only,
    images=IMAGES,
)
