"""DeepSeek-V3's declaration: parameter counts against the built modules, the planner shape, the sharding plan's
dense and MoE layers, and config.json reading."""

import dataclasses
import json

import pytest
import torch

from openrecipes.models.deepseek_v3.config import DeepseekV3Config
from openrecipes.models.deepseek_v3.model import DeepseekV3ForCausalLM
from openrecipes.models.families import family_for_config
from openrecipes.models.registry import get_config


def _count_from_module(config: DeepseekV3Config) -> tuple[int, int, int]:
    """(total, active, frozen) from the module's parameters (meta device), independently of the config's formulas."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
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


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v3-671b"])
def test_formulas_agree_with_the_built_modules(name):
    config = get_config(name)
    assert _count_from_module(config) == (config.total_params(), config.active_params(), config.frozen_params())


def test_published_size():
    config = get_config("deepseek-v3-671b")
    assert round(config.total_params() / 1e9) == 671 and round(config.active_params() / 1e9) == 37


def test_planner_shape_describes_dense_layers_shared_experts_and_latent_attention():
    config = get_config("deepseek-v3-tiny")
    shape = family_for_config(config).planner_shape(config, "deepseek-v3-tiny")
    assert shape.moe_layers == (False, True, True) and shape.num_moe_layers == 2
    assert shape.q_width == 4 * 24 and shape.kv_width == 4 * (24 + 12) // 2  # keys 24 wide a head, values 12
    assert shape.widths.latent == 48 + 32 + 8
    # one layer's non-expert matmuls, averaged: the dense MLP once, router and shared expert twice
    per_layer = (config.dense_mlp_params() + 2 * (config.router_params() + config.shared_expert_params())) / 3
    assert shape.dense_layer_matmul_params() == pytest.approx(config.attention_params() + per_layer)
    layers = config.num_hidden_layers
    assert (shape.embedding_params + shape.lm_head_params + layers * shape.dense_layer_matmul_params()
            + shape.num_moe_layers * shape.num_experts * shape.expert_params
            + layers * shape.small_params_per_layer + shape.hidden) == pytest.approx(config.total_params())


def test_sharding_plan_leaves_dense_layers_out_of_the_moe_blocks():
    config = get_config("deepseek-v3-tiny")
    family = family_for_config(config)
    model = family.build(config, device="meta", dtype=torch.float32, seed=None)
    plan = family.sharding
    layers = plan.decoder_layers(model)
    assert plan.moe_of(layers[0]) is None and plan.experts_of(layers[0]) is layers[0].mlp
    assert plan.moe_blocks(layers) == [layers[1].mlp, layers[2].mlp]
    assert plan.experts_of(layers[1]) is layers[1].mlp.experts
    split = [n for n, _ in model.named_parameters() if any(f".{p}." in n for p in plan.attention_tp)]
    assert {n.split(".")[-2] for n in split} == {"q_b_proj", "kv_b_proj", "o_proj"}


def _hf_config(**changes):
    raw = get_config("deepseek-v3-tiny").to_hf_dict()
    raw.update(changes)
    return raw


def test_hf_config_round_trip():
    config = get_config("deepseek-v3-tiny")
    assert DeepseekV3Config.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


@pytest.mark.parametrize("changes, message", [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), r"rope_scaling\.rope_type='longrope'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0, "beta_fast": 8}),
     r"rope_scaling\.beta_fast=8 is not read by dynamic RoPE"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 40.0}), r"rope_scaling\.original_max_position_embeddings"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 8}), r"rope_scaling\.beta_fast=8 is not read"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": -1.0, "original_max_position_embeddings": 8}),
     r"rope_scaling\.factor must be a positive number"),
    (dict(aux_loss_alpha=0.001), "'aux_loss_alpha'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=3), "topk_group"),
    (dict(qk_head_dim=99), "qk_head_dim=99"),
    (dict(hidden_size="64"), "hidden_size='64'"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps' must be positive"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps' must be positive"),
    (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
])
def test_bad_config_json_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV3Config.from_hf_dict(_hf_config(**changes), source="config.json")


def test_a_yarn_config_round_trips_through_config_json():
    # as a checkpoint's config: holding the MTP layer it declares (the registered size holds none, so it declares none)
    config = dataclasses.replace(get_config("deepseek-v3-671b"), keep_mtp=True)
    assert config.rope_scaling.kind == "yarn"
    assert DeepseekV3Config.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config
    assert get_config("deepseek-v3-671b").to_hf_dict()["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v3-671b"])
def test_formulas_agree_with_the_built_modules_holding_mtp_layers(name):
    """Each MTP layer held adds a MoE decoder layer, its projection and norms; N counts the shared head once more (it
    runs again at each depth), which no module of the MTP layer holds."""
    config = dataclasses.replace(get_config(name), num_nextn_predict_layers=2, keep_mtp=True)
    total, active, frozen = _count_from_module(config)
    assert (total, active + 2 * config.lm_head_params(), frozen) == (
        config.total_params(), config.active_params(), config.frozen_params())
    assert config.total_params() > dataclasses.replace(config, keep_mtp=False).total_params()
