"""The planner's peak memory for each knob the tuner turns against the H200's measured peak
(bench/results/2026-12-02-memory-knobs-h200.json: 8 layers at Qwen3-30B-A3B widths, one knob at a time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrecipes.config.recipe import load_recipe
from openrecipes.tune.predict import Planner, Target

ROOT = Path(__file__).resolve().parents[2]
MEASURED = json.loads((ROOT / "bench/results/2026-12-02-memory-knobs-h200.json").read_text())
TARGET = 0.05
# where the planner is known to miss by more than the target (BENCHMARKS.md): the eager unchunked loss of several
# rows per microbatch holds more per logits element than of one row (full-r2, full-r4, under-predicted), and the
# chunked loss without recompute holds less than predicted (chunk2048-none-r2)
KNOWN_MISSES = {"full-r4": 0.16, "full-r2": 0.07, "chunk2048-none-r2": 0.09}


@pytest.mark.parametrize("row", MEASURED["results"], ids=lambda row: row["variant"])
def test_planner_peak_within_target_of_the_measured_peak(row: dict) -> None:
    recipe = load_recipe(ROOT / MEASURED["recipe"], MEASURED["base_overrides"] + row["overrides"])
    predicted = Planner(recipe, Target(count=1, gpu_type="H200"), 8192).predict(recipe).allocated_gib
    error = abs(predicted - row["measured_peak_gib"]) / row["measured_peak_gib"]
    assert error <= KNOWN_MISSES.get(row["variant"], TARGET), (predicted, row["measured_peak_gib"])


def test_every_knob_the_tuner_turns_was_measured() -> None:
    variants = {row["variant"] for row in MEASURED["results"]}
    for knob in ("none", "selective", "attention_core", "experts", "block4", "offload0.5", "actoffload", "compile",
                 "chunk2048", "r2", "r4"):
        assert any(knob in name for name in variants), knob
