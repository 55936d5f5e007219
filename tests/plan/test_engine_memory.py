"""The planner's model of this engine's memory against the peaks measured on H200s (bench/results)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from openrecipes.models.registry import get_config
from openrecipes.config.layout import LayoutConfig
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.memory import TrainingSetup
from openrecipes.plan.shape import model_shape

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def measured_peak(file_name: str, variant: str) -> float:
    report = json.loads((RESULTS / file_name).read_text())
    (result,) = [r for r in report["results"] if r["variant"] == variant]
    return result["measure"]["peak_memory_gib"]


@pytest.mark.parametrize("file_name,variant,layout,optimizer", [
    ("2026-11-29-engine_speed-1gpu-h200-final.json", "single_bal", dict(), "precision-aware"),
    ("2026-11-29-engine_speed-2gpu-h200.json", "dp2_bal", dict(dp=2), "adam"),
    ("2026-11-29-engine_speed-2gpu-h200.json", "dp2ep2_bal", dict(dp=2, ep=2), "adam"),
])
def test_predicted_peak_within_10_percent_of_measured(file_name, variant, layout, optimizer):
    shape = model_shape(replace(get_config("qwen3-30b-a3b"), num_hidden_layers=8))
    layout = LayoutConfig(max_tokens_per_gpu=8192, **layout)
    setup = TrainingSetup(recompute="full", optimizer=optimizer, global_batch_tokens=8192 * layout.dp,
                          engine="openrecipes")
    predicted = evaluate(shape, layout, setup, load_hardware("H200")).to_json()["per_stage_allocated_gib"][0]
    measured = measured_peak(file_name, variant)
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


def test_pipeline_without_data_parallel_keeps_weights_unsharded():
    # PP2 with dp = 1: no FSDP2, so each stage keeps bf16 parameters (2 B), fp32 gradient accumulators with several
    # microbatches (4 B) and the whole optimizer state of its layers, and no gathered copies; DP2 shards them
    from openrecipes.plan.hardware import GIB
    from openrecipes.plan.memory import openrecipes_weight_gib, stage_params

    shape = model_shape(get_config("qwen3-moe-tiny"))
    setup = TrainingSetup(optimizer="adam", engine="openrecipes", global_batch_tokens=8 * 256)
    layout = LayoutConfig(max_tokens_per_gpu=256, pp=2)
    for stage, (first, last) in enumerate(((True, False), (False, True))):
        held = sum(stage_params(shape, layout, shape.num_layers // 2, first=first, last=last, engine="openrecipes"))
        weights = openrecipes_weight_gib(shape, layout, setup, shape.num_layers // 2, first=first, last=last)
        assert {k: v * GIB for k, v in weights.items()} == {"params": 2 * held, "grads": 4 * held,
                                                           "optimizer": 12 * held}, stage
    sharded = openrecipes_weight_gib(shape, layout.model_copy(update={"dp": 2}), setup, shape.num_layers // 2,
                                     first=False, last=True)
    assert sharded["optimizer"] < weights["optimizer"]  # the last stage's


def test_the_sdpa_sink_mask_is_counted_and_the_flex_path_makes_none():
    """gpt-oss through SDPA keeps one (rows, heads, T, T+1) bf16 mask per layer kept without recompute; its flex path,
    and a model without sinks, none."""
    from openrecipes.plan.memory import sink_mask_bytes

    shape = model_shape(replace(get_config("gpt-oss-20b"), num_hidden_layers=4,
                                layer_types=["sliding_attention", "full_attention"] * 2))
    layout = LayoutConfig(max_tokens_per_gpu=4096)
    hardware = load_hardware("H100")

    def peak(kernel: str, model=shape, recompute="none") -> float:
        setup = TrainingSetup(recompute=recompute, optimizer="precision-aware", global_batch_tokens=4096,
                              engine="openrecipes", attention_kernel=kernel)
        return evaluate(model, layout, setup, hardware).to_json()["per_stage_allocated_gib"][0]

    mask = sink_mask_bytes(shape, layout, TrainingSetup(engine="openrecipes")) / 2**30
    assert mask == pytest.approx(2 * 4096 * 64 * 4097 / 2**30)
    assert peak("sdpa") == pytest.approx(peak("auto"))
    assert peak("sdpa") - peak("flex") >= 4 * mask - 0.01  # the figures are rounded to 0.01 GiB
    assert peak("flex") == pytest.approx(peak("sdpa", model=replace(shape, attention_sinks=False)))
    assert peak("flex", recompute="full") < peak("sdpa", recompute="full")
