"""The long-context SFT workflow end to end on CPU: the example recipe (4,096-token rows, CP2 over two processes)
trains, resumes bitwise, and its card (`card new`) validates and says `workflow: long-context-sft`.

The three trainings (uninterrupted, cut after its first step, resumed) run in one 2-process launch."""

import json
from pathlib import Path

import pytest

from openrecipes.config.recipe import load_recipe
from openrecipes.data.build import build_recipe_rows
from tests.distributed.test_long_context import _launch
from tests.train.workflow_card import workflow_card

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-long-context.yaml"


def _metrics(run_dir: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_long_context_example_trains_resumes_bitwise_and_writes_its_card(tmp_path):
    recipe = load_recipe(EXAMPLE)
    assert recipe.data.build.row_tokens >= 4096 and recipe.layout.cp == 2
    rows = tmp_path / "rows"  # built once, as `train` does before it starts the processes
    build_recipe_rows(recipe.data.build, rows)
    sets = [f"data.rows={rows}", "data.build=null", "steps=2", "global_batch=1", "checkpoint.every=1",
            "logging.progress=false"]
    whole, cut = tmp_path / "whole" / "run", tmp_path / "cut" / "run"
    _launch([{"example": str(EXAMPLE), "overrides": sets, "run_dir": str(whole)},
             {"example": str(EXAMPLE), "overrides": sets, "run_dir": str(cut), "stop_after": 0},
             {"example": str(EXAMPLE), "overrides": sets, "run_dir": str(cut), "resume": True}],
            tmp_path / "runs.json", 2)
    assert _metrics(cut) == _metrics(whole) and len(_metrics(whole)) == 2
    assert json.loads((whole / "metrics.jsonl").read_text().splitlines()[0])["tokens"] == 4096
    card = workflow_card(cut, whole, tmp_path / "recipes", (1, 1)).card
    assert card.workload.workflow == "long-context-sft" and card.layout.cp == 2 and card.workload.row_tokens == 4096
