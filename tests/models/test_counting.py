"""Parameter counts: N (active, excluding input embedding and norms) and totals."""

import torch

from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig
from openrecipes.models.qwen3_moe.model import Qwen3MoeForCausalLM
from openrecipes.models.registry import get_config


def test_qwen3_30b_a3b_active_params_is_the_published_figure():
    config = get_config("qwen3-30b-a3b")
    assert config.active_params() == 3_041_656_832
    assert round(config.total_params() / 1e9, 1) == 30.5


def _count_from_module(config: Qwen3MoeConfig) -> tuple[int, int]:
    """Count from the module's real parameters (meta device), independently of the config's formulas."""
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    total = active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if "embed_tokens" in name or "norm" in name:
            continue
        if ".experts." in name:
            active += param.numel() * config.num_experts_per_tok // config.num_experts
        else:
            active += param.numel()
    return total, active


def test_formulas_agree_with_the_built_modules():
    for name in ("qwen3-30b-a3b", "qwen3-moe-tiny"):
        config = get_config(name)
        assert _count_from_module(config) == (config.total_params(), config.active_params()), name


def test_formulas_agree_with_dense_layers():
    # mlp_only_layers and decoder_sparse_step make layers 0 and 2 dense (of 4): their MLP replaces router and experts
    import dataclasses

    config = dataclasses.replace(get_config("qwen3-moe-tiny"), mlp_only_layers=(0,), decoder_sparse_step=2)
    assert config.dense_layers == (0, 2) and config.num_moe_layers == 2
    assert _count_from_module(config) == (config.total_params(), config.active_params())
    assert config.total_params() != get_config("qwen3-moe-tiny").total_params()


def test_the_planner_sees_dense_layers_and_the_window():
    import dataclasses

    from openrecipes.models.families import family_for_config

    config = dataclasses.replace(get_config("qwen3-moe-tiny"), mlp_only_layers=(1,), sliding_window=64)
    shape = family_for_config(config).planner_shape(config, "tiny")
    assert shape.moe_layers == (True, False, True, True) and shape.attention_windows == (64,) * 4
    assert shape.active_params == config.active_params()
