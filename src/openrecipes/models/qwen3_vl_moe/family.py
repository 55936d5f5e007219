"""Qwen3-VL-MoE's declaration: named configs, HF mapping, planner shape, chat format and sharding plan. The decoder
is Qwen3-MoE's, so its planner shape and sharding are Qwen3-MoE's under ``model.language_model``; the vision tower is
whole on every rank and counted by the planner as a frozen encoder."""

from __future__ import annotations

from dataclasses import replace

from openrecipes.models.families import ImageInputs, ModelFamily, ShardingPlan
from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig
from openrecipes.models.qwen3_moe.family import FAMILY as QWEN3_MOE
from openrecipes.models.qwen3_vl_moe import hf
from openrecipes.models.qwen3_vl_moe.config import Qwen3VLMoeConfig, Qwen3VLMoeVisionConfig
from openrecipes.models.qwen3_vl_moe.model import (Qwen3VLMoeForConditionalGeneration, build_qwen3_vl_moe,
                                                  packed_mrope_positions)
from openrecipes.models.shape import ModelShape


def planner_shape(config: Qwen3VLMoeConfig, name: str) -> ModelShape:
    shape = QWEN3_MOE.planner_shape(config.text, name or "qwen3-vl-moe")
    return replace(shape, frozen_encoder_params=config.vision.params(),
                   encoder_projection_params=config.vision.projection_params())


NAMED_CONFIGS = {
    # Qwen/Qwen3-VL-30B-A3B-Instruct config.json, field by field: Qwen3-30B-A3B's decoder sizes with
    # rope_theta 5e6 and 256k positions, a 27-block vision tower with DeepStack after blocks 8, 16 and 24.
    "qwen3-vl-30b-a3b": lambda: Qwen3VLMoeConfig(
        text=Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
            rope_theta=5_000_000.0, max_position_embeddings=262144, bos_token_id=151643, eos_token_id=151645),
        vision=Qwen3VLMoeVisionConfig(
            depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
            deepstack_visual_indexes=(8, 16, 24)),
        mrope_section=(24, 20, 20)),
    # Small enough for CPU tests; its vocabulary is the bundled image-text tokenizer's (the bundled 1,024 tokens and
    # Qwen3-VL's image tokens after them, data/assets/image_text/make_image_text.py).
    "qwen3-vl-moe-tiny": lambda: Qwen3VLMoeConfig(
        text=Qwen3MoeConfig(
            vocab_size=1028, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, rope_theta=10_000.0, max_position_embeddings=4096),
        vision=Qwen3VLMoeVisionConfig(
            depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=4,
            temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=(0, 1)),
        mrope_section=(2, 3, 3), image_token_id=1026, video_token_id=1027, vision_start_token_id=1024,
        vision_end_token_id=1025),
}

_TEXT = QWEN3_MOE.sharding
FAMILY = ModelFamily(
    name="qwen3_vl_moe", named_configs=NAMED_CONFIGS, model_class=Qwen3VLMoeForConditionalGeneration,
    planner_shape=planner_shape, chat_format=QWEN3_MOE.chat_format,
    sharding=ShardingPlan(
        layers="model.language_model.layers", embedding="model.language_model.embed_tokens",
        final_norm="model.language_model.norm", lm_head="lm_head", attention=_TEXT.attention, moe=_TEXT.moe,
        attention_tp=_TEXT.attention_tp, experts=_TEXT.experts, replicated=(*_TEXT.replicated, "model.visual."),
    ),
    model_types=("qwen3_vl_moe",), config_class=Qwen3VLMoeConfig,
    config_from_hf=lambda raw, source: Qwen3VLMoeConfig.from_hf_dict(raw, source=source),
    config_to_hf=lambda config: config.to_hf_dict(), build=build_qwen3_vl_moe,
    native_parts=hf.native_parts, to_hf=hf.to_hf,
    aux_loss=QWEN3_MOE.aux_loss,  # the text decoder's router; the config reads its fields from text_config
    images=ImageInputs(
        towers=("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
        projection=("model.visual.merger", "model.visual.deepstack_merger_list"),
        image_token_id=lambda config: config.image_token_id,
        patch_geometry=lambda config: (config.vision.patch_size, config.vision.temporal_patch_size,
                                       config.vision.spatial_merge_size),
        positions=lambda config, input_ids, position_ids, grid, held: packed_mrope_positions(
            position_ids, input_ids == config.image_token_id, grid, held, config),
        first_stage_layers=lambda config: len(config.vision.deepstack_visual_indexes)),
)
