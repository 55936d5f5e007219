"""GLM-4.5-MoE's declaration: parameter counts against the built modules, the planner shape, the sharding plan's
dense and MoE layers, and config.json reading."""

import dataclasses
import json

import pytest
import torch

from openrecipes.models.families import family_for_config
from openrecipes.models.glm4_moe.config import Glm4MoeConfig
from openrecipes.models.glm4_moe.model import Glm4MoeForCausalLM
from openrecipes.models.registry import get_config


def _count_from_module(config: Glm4MoeConfig) -> tuple[int, int, int]:
    """(total, active, frozen) from the module's parameters (meta device), independently of the config's formulas."""
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(config)
    total = active = frozen = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            frozen += param.numel()
            continue
        total += param.numel()
        if "embed_tokens" in name or "norm" in name:
            continue
        if ".mlp.experts." in name:
            active += param.numel() * config.num_experts_per_tok // config.n_routed_experts
        else:
            active += param.numel()
    return total, active, frozen


@pytest.mark.parametrize("name, changes", [
    ("glm4-moe-tiny", {}), ("glm-4.5-air", {}),
    ("glm4-moe-tiny", dict(use_qk_norm=False, attention_bias=False, first_k_dense_replace=0, n_shared_experts=2)),
    ("glm4-moe-tiny", dict(first_k_dense_replace=3)),  # every layer dense
])
def test_formulas_agree_with_the_built_modules(name, changes):
    config = dataclasses.replace(get_config(name), **changes)
    assert _count_from_module(config) == (config.total_params(), config.active_params(), config.frozen_params())


def test_published_size():
    """GLM-4.5-Air: 106B parameters, 12B active (zai-org's model card), without its MTP layer."""
    config = get_config("glm-4.5-air")
    assert round(config.total_params() / 1e9) == 107 and round(config.active_params() / 1e9) == 13
    assert config.rotary_dim == 64


def test_planner_shape_describes_dense_layers_shared_experts_and_gqa_widths():
    config = get_config("glm4-moe-tiny")
    shape = family_for_config(config).planner_shape(config, "glm4-moe-tiny")
    assert shape.moe_layers == (False, True, True) and shape.num_moe_layers == 2
    assert shape.q_width == 4 * 24 and shape.kv_width == 2 * 24  # heads * head_dim != hidden (64)
    per_layer = (config.dense_mlp_params() + 2 * (config.router_params() + config.shared_expert_params())) / 3
    assert shape.dense_layer_matmul_params() == pytest.approx(config.attention_params() + per_layer)
    layers = config.num_hidden_layers
    assert (shape.embedding_params + shape.lm_head_params + layers * shape.dense_layer_matmul_params()
            + shape.num_moe_layers * shape.num_experts * shape.expert_params
            + layers * shape.small_params_per_layer + shape.hidden) == pytest.approx(config.total_params())


def test_sharding_plan_leaves_dense_layers_out_of_the_moe_blocks():
    config = get_config("glm4-moe-tiny")
    family = family_for_config(config)
    model = family.build(config, device="meta", dtype=torch.float32, seed=None)
    plan = family.sharding
    layers = plan.decoder_layers(model)
    assert plan.moe_of(layers[0]) is None and plan.experts_of(layers[0]) is layers[0].mlp
    assert plan.moe_blocks(layers) == [layers[1].mlp, layers[2].mlp]
    split = [n for n, _ in model.named_parameters() if any(f".{p}." in n for p in plan.attention_tp)]
    assert {n.split(".")[-2] for n in split} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert layers[0].self_attn.o_proj.bias is None and layers[0].self_attn.q_proj.bias is not None


def _hf_config(**changes):
    raw = get_config("glm4-moe-tiny").to_hf_dict()
    raw.update(changes)
    return raw


def test_hf_config_round_trip():
    config = get_config("glm4-moe-tiny")
    assert Glm4MoeConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


def test_the_published_spelling_reads_as_the_registered_size():
    """zai-org/GLM-4.5-Air's config.json spelling: rope_theta and partial_rotary_factor at the top level, a null
    rope_scaling, several eos ids; its MTP layer declared."""
    config = get_config("glm-4.5-air")
    raw = config.to_hf_dict()
    del raw["rope_parameters"]
    raw.update(rope_scaling=None, rope_theta=1000000, partial_rotary_factor=0.5, num_nextn_predict_layers=1,
               eos_token_id=[151329, 151336, 151338], torch_dtype="bfloat16")
    assert Glm4MoeConfig.from_hf_dict(raw) == config


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), r"rope_type='yarn'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}), r"rope_parameters\.factor"),
    (dict(partial_rotary_factor=0.25), "partial_rotary_factor=0.25 contradicts"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}),
     "partial_rotary_factor=0.3 must give an even"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=3), "topk_group"),
    (dict(hidden_size="64"), "hidden_size='64'"),
    (dict(head_dim="24"), "head_dim='24'"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps' must be positive"),
    (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(num_local_experts=4), "num_local_experts=4 contradicts n_routed_experts"),
    (dict(scoring_func="softmax"), "'scoring_func'"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(model_type="deepseek_v3"), "model_type"),
])
def test_bad_config_json_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        Glm4MoeConfig.from_hf_dict(_hf_config(**changes), source="config.json")


def test_head_dim_defaults_to_hidden_over_heads_and_aliases_read():
    raw = _hf_config(num_mtp_layers=2, num_local_experts=8)
    del raw["head_dim"], raw["n_routed_experts"], raw["num_nextn_predict_layers"]
    config = Glm4MoeConfig.from_hf_dict(raw)
    assert config.head_dim == 64 // 4 and config.num_nextn_predict_layers == 2 and config.n_routed_experts == 8
