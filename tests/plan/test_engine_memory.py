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
