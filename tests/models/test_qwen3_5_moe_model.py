"""Qwen3.5-MoE's declaration: parameter counts against the built modules, the planner shape, config.json reading and
its refusals, and the layouts refused by name on its linear-attention layers."""

import dataclasses

import pytest
import torch

from openrecipes.models.families import family_for_config
from openrecipes.models.qwen3_5_moe.config import Qwen35MoeConfig
from openrecipes.models.qwen3_5_moe.model import Qwen35MoeForCausalLM, build_qwen3_5_moe
from openrecipes.models.registry import get_config


def _count_from_module(config: Qwen35MoeConfig) -> tuple[int, int]:
    """(total, active) from the module's parameters (meta device), independently of the config's formulas."""
    with torch.device("meta"):
        model = Qwen35MoeForCausalLM(config)
    total = active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if "embed_tokens" in name or "norm" in name:
            continue
        scale = config.num_experts_per_tok / config.num_experts if ".mlp.experts." in name else 1
        active += int(param.numel() * scale)
    return total, active


@pytest.mark.parametrize("changes", [
    {}, dict(attention_bias=True), dict(layer_types=("full_attention",) * 4),
    dict(layer_types=("linear_attention",) * 4, linear_conv_kernel_dim=3, linear_num_value_heads=6),
])
def test_formulas_agree_with_the_built_modules(changes):
    config = dataclasses.replace(get_config("qwen3.5-moe-tiny"), **changes)
    assert _count_from_module(config) == (config.total_params(), config.active_params())


def test_planner_shape_counts_every_mixer():
    config = get_config("qwen3.5-moe-tiny")
    shape = family_for_config(config).planner_shape(config, "qwen3.5-moe-tiny")
    layers = config.num_hidden_layers
    assert shape.q_width == 4 * 16 and shape.kv_width == 2 * 16 and shape.attention_output_gate
    assert layers * shape.attention_params == config.mixer_params()  # the tiny config's sum divides evenly
    total = (shape.embedding_params + shape.lm_head_params + layers * shape.dense_layer_matmul_params()
             + layers * shape.num_experts * shape.expert_params + layers * shape.small_params_per_layer
             + config.hidden_size)
    assert total == config.total_params()


def test_the_planners_delta_rule_flops_are_the_chunked_kernels():
    """The formula the planner reckons linear attention by is the chunked kernel's own count: the batched matmuls
    torch's flop counter sees, plus the triangular solve (C(K+V) per token and head), which it does not count."""
    from torch.utils.flop_counter import FlopCounterMode

    from openrecipes.models.qwen3_5_moe.delta_rule import (DEFAULT_CHUNK, chunked_flops_per_token,
                                                            gated_delta_rule_chunked)

    rows, heads, tokens, key, value = 2, 3, 3 * DEFAULT_CHUNK, 32, 48
    q, k = torch.randn(rows, heads, tokens, key), torch.randn(rows, heads, tokens, key)
    v, beta = torch.randn(rows, heads, tokens, value), torch.rand(rows, heads, tokens)
    g = -torch.rand(rows, heads, tokens)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule_chunked(q, k, v, g, beta)
    solve = rows * tokens * heads * DEFAULT_CHUNK * (key + value)
    assert counter.get_total_flops() + solve == rows * tokens * chunked_flops_per_token(key, value, heads)


def test_the_planner_reckons_linear_attention_per_token_and_full_attention_per_pair():
    from openrecipes.config.layout import LayoutConfig
    from openrecipes.plan.enumerate import evaluate
    from openrecipes.plan.hardware import load_hardware
    from openrecipes.plan.memory import TrainingSetup

    config = get_config("qwen3.5-35b-a3b")
    shape = family_for_config(config).planner_shape(config, "qwen3.5-35b-a3b")
    linear, full = config.layer_types.index("linear_attention"), config.layer_types.index("full_attention")
    for seq in (4096, 32768):  # linear: the same per token at any length; full: in proportion to the context
        assert shape.attention_flops(linear, seq, seq) == seq * shape.linear_attention_flops_per_token
    assert shape.attention_flops(full, 32768, 32768) / 32768 == pytest.approx(
        8 * shape.attention_flops(full, 4096, 4096) / 4096, rel=1e-3)
    # through the planner: longer rows slow the hybrid model less than the same widths counted as softmax attention
    softmax_only = dataclasses.replace(shape, linear_attention_layers=None)
    setup, hw = TrainingSetup(recompute="full", optimizer="precision-aware"), load_hardware("H200")

    def tokens_per_s(model_shape, row: int) -> float:
        layout = LayoutConfig(dp=8, max_tokens_per_gpu=row, rows_per_microbatch=1)
        return evaluate(model_shape, layout, setup, hw).throughput.tokens_per_s_per_gpu

    hybrid_loss = tokens_per_s(shape, 32768) / tokens_per_s(shape, 4096)
    softmax_loss = tokens_per_s(softmax_only, 32768) / tokens_per_s(softmax_only, 4096)
    assert softmax_loss < hybrid_loss < 1


def test_config_json_round_trip_and_refusals():
    config = get_config("qwen3.5-moe-tiny")
    raw = config.to_hf_dict()
    assert Qwen35MoeConfig.from_hf_dict(raw) == config
    no_types = {k: v for k, v in raw.items() if k != "layer_types"}
    assert Qwen35MoeConfig.from_hf_dict(no_types).layer_types == config.layer_types  # every fourth: full
    assert Qwen35MoeConfig.from_hf_dict({**no_types, "full_attention_interval": 2}).layer_types == (
        "linear_attention", "full_attention") * 2
    with pytest.raises(ValueError, match="unknown Qwen3.5-MoE config field 'norm_topk_prob'"):
        Qwen35MoeConfig.from_hf_dict({**raw, "norm_topk_prob": False})
    with pytest.raises(ValueError, match="rope_parameters.rope_type='yarn' is not supported"):
        Qwen35MoeConfig.from_hf_dict({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="'layer_types'"):
        Qwen35MoeConfig.from_hf_dict({**raw, "layer_types": ["linear_attention", "sliding_attention"] * 2})
    with pytest.raises(ValueError, match="full_attention_interval=3 contradicts layer_types"):
        Qwen35MoeConfig.from_hf_dict({**raw, "full_attention_interval": 3})
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        Qwen35MoeConfig.from_hf_dict({**raw, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="model_type is 'qwen3_5_moe'"):
        Qwen35MoeConfig.from_hf_dict({**raw, "model_type": "qwen3_5_moe"})


def test_tensor_and_context_parallelism_are_refused_on_linear_attention():
    model = build_qwen3_5_moe(get_config("qwen3.5-moe-tiny"))
    plan = family_for_config(model.config).sharding
    linear = plan.attention_of(model.model.layers["0"])
    assert linear is model.model.layers["0"].linear_attn
    assert plan.attention_of(model.model.layers["3"]) is model.model.layers["3"].self_attn
    with pytest.raises(ValueError, match=r"tensor parallelism \(layout.tp\) is not supported"):
        linear.register_forward_pre_hook(lambda *args: None)
    with pytest.raises(ValueError, match=r"layout.cp"):
        linear.backend = lambda *args, **kwargs: None


def test_one_process_trains_a_step():
    model = build_qwen3_5_moe(get_config("qwen3.5-moe-tiny"), seed=0)
    ids = torch.randint(0, 1024, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert torch.isfinite(logits).all()
    for name, param in model.named_parameters():  # every parameter reached (experts: some may go unchosen)
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
