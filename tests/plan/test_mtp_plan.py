"""The planner counts the multi-token-prediction layers a run trains (DeepSeek-V3, recipe mtp): their parameters in
the shape (against the config's count of the built model), more weights and activations, more compute, a larger N."""

from dataclasses import replace

import pytest

from openrecipes.config.layout import LayoutConfig
from openrecipes.models.registry import get_config
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.memory import TrainingSetup, stage_params
from openrecipes.plan.shape import model_shape


def _shapes(name: str, layers: int = 1):
    config = replace(get_config(name), num_nextn_predict_layers=layers, keep_mtp=True)
    return config, model_shape(replace(config, keep_mtp=False)), model_shape(config)


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v3-671b"])
def test_the_shape_holds_the_mtp_layers_parameters(name):
    config, plain, shape = _shapes(name, layers=2)
    assert (plain.mtp_layers, shape.mtp_layers) == (0, 2)
    layers = shape.num_layers
    total = (shape.embedding_params + shape.lm_head_params + layers * shape.dense_layer_matmul_params()
             + shape.num_moe_layers * shape.num_experts * shape.expert_params + layers * shape.small_params_per_layer
             + shape.hidden + 2 * (shape.mtp_layer_dense_params() + shape.num_experts * shape.expert_params))
    assert total == pytest.approx(config.total_params())
    layout = LayoutConfig(max_tokens_per_gpu=64)
    (dense, experts), (dense0, experts0) = (stage_params(s, layout, layers, first=True, last=True)
                                            for s in (shape, plain))
    assert dense + experts - dense0 - experts0 == config.total_params() - replace(config, keep_mtp=False).total_params()


def test_training_the_mtp_layer_costs_memory_and_time_and_counts_in_n():
    _, plain, shape = _shapes("deepseek-v3-671b")
    layout = LayoutConfig(max_tokens_per_gpu=4096, pp=8, pp_first_stage_layers=5, ep=8, dp=8)
    setup = TrainingSetup(recompute="full", engine="openrecipes", global_batch_tokens=64 * 4096)
    hw = load_hardware("H200")
    with_mtp, without = evaluate(shape, layout, setup, hw), evaluate(plain, layout, setup, hw)
    last, last0 = with_mtp.stages[-1], without.stages[-1]
    assert last.parts_gib["params"] > last0.parts_gib["params"]
    assert last.parts_gib["activations"] > last0.parts_gib["activations"]
    assert with_mtp.stages[0].allocated_gib == without.stages[0].allocated_gib  # the MTP layer is the last stage's
    assert with_mtp.throughput.step_time_s > without.throughput.step_time_s
    assert shape.active_params > plain.active_params  # N: the MTP layer's active parameters and the head once more
