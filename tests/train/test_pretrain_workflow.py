"""The pretraining workflow end to end on CPU: the example recipe builds its rows, trains, resumes bitwise, and
its card (`card new`) validates and says `workflow: pretrain`."""

from __future__ import annotations

import json
from pathlib import Path

from openrecipes.cards.dataset import card_workflow, dataset_block
from openrecipes.config.recipe import load_recipe
from openrecipes.config.rundir import rows_directory
from openrecipes.data.build import build_recipe_rows
from openrecipes.data.manifest import read_manifest
from openrecipes.train.loop import train
from tests.train.workflow_card import workflow_card

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-pretrain.yaml"


def _losses(run_dir: Path) -> list[tuple[float, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in records]


def _recipe(run_dir: Path):
    return load_recipe(EXAMPLE, [f"run_dir={run_dir}", "steps=4", "global_batch=4", "logging.progress=false",
                                 "checkpoint.every=2", "data.build.rows=16"])


def test_pretrain_example_builds_trains_and_resumes_bitwise(tmp_path: Path) -> None:
    whole, cut = _recipe(tmp_path / "whole"), _recipe(tmp_path / "cut")
    for recipe in (whole, cut):
        build_recipe_rows(recipe.data.build, rows_directory(None, recipe.run_dir))
    manifest = read_manifest(rows_directory(None, whole.run_dir))
    assert manifest["workflow"] == "pretrain" and manifest["eos_token"] == "<|endoftext|>"
    assert manifest["supervised_token_ratio"] > 0.9  # every target but document starts
    train(whole, command="t")
    train(cut, command="t", stop_after=1)
    train(cut, command="t", resume=True)
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
    assert card_workflow(whole, manifest) == "pretrain"
    card = workflow_card(tmp_path / "cut", tmp_path / "whole", tmp_path / "recipes", (1, 3)).card
    assert card.workload.workflow == "pretrain" and card.workload.rows == "pretraining documents"
    block = dataset_block(manifest, "0")
    assert block["name"] == "openrecipes bundled documents" and "documents.jsonl" in block["source"]
    assert "chat template" not in block["build"]["tokenizer"]


def test_rows_built_before_the_workflow_field_are_sft() -> None:
    recipe = load_recipe(EXAMPLE)
    assert card_workflow(recipe, {"rows": 1}) == "sft"


def test_sft_rows_over_context_parallel_ranks_are_long_context_sft() -> None:
    cp2 = load_recipe(EXAMPLE, ["layout.cp=2"])
    assert card_workflow(cp2, {"workflow": "sft"}) == "long-context-sft"
    assert card_workflow(cp2, {"workflow": "pretrain"}) == "pretrain"  # long pretraining rows stay pretraining
    # on one process, rows of the seeds' long-context length are long-context SFT too; shorter ones stay SFT
    one = load_recipe(EXAMPLE)
    assert card_workflow(one, {"workflow": "sft", "row_tokens": 32768}) == "long-context-sft"
    assert card_workflow(one, {"workflow": "sft", "row_tokens": 32767}) == "sft"
    assert card_workflow(one, {"workflow": "pretrain", "row_tokens": 65536}) == "pretrain"


def test_sft_only_fields_are_refused_for_pretrain() -> None:
    import pytest

    with pytest.raises(ValueError, match="data.build: chat_template apply to format sft only"):
        load_recipe(EXAMPLE, ["data.build.chat_template=qwen3"])
