"""Rows holding token ids beyond the model's vocabulary are refused before step 0, in one line naming rows and model;
the largest id is the manifest's max_token_id, or read from the parquet file for rows built before it was recorded."""

import json
import shutil

import numpy as np
import pytest
import yaml

from openrecipes.cli import main
from openrecipes.data.batching import load_rows
from openrecipes.data.manifest import MANIFEST_FILE, MAX_TOKEN_ID, rows_max_token_id


def test_the_manifest_records_the_largest_id_of_the_rows(rows_dir, tmp_path):
    largest = int(load_rows(rows_dir).input_ids.max())
    assert json.loads((rows_dir / MANIFEST_FILE).read_text())[MAX_TOKEN_ID] == largest
    older = _without_recorded_max(rows_dir, tmp_path)
    assert rows_max_token_id(older) == largest == rows_max_token_id(rows_dir)


def _without_recorded_max(rows_dir, tmp_path):
    """A copy of the rows as a build from before max_token_id was recorded wrote them."""
    older = tmp_path / "older-rows"
    shutil.copytree(rows_dir, older)
    manifest = json.loads((older / MANIFEST_FILE).read_text())
    del manifest[MAX_TOKEN_ID]
    (older / MANIFEST_FILE).write_text(json.dumps(manifest))
    return older


@pytest.mark.parametrize("recorded", [True, False], ids=["manifest", "parquet"])
def test_ids_beyond_the_vocabulary_are_refused_before_step_0(rows_dir, tmp_path, capsys, recorded):
    rows = rows_dir if recorded else _without_recorded_max(rows_dir, tmp_path)
    largest = int(load_rows(rows_dir).input_ids.max())
    vocab_size = 512
    assert largest >= vocab_size  # the bundled tokenizer's 1,024 ids: the rows use ids the smaller model lacks
    recipe = {"model": "qwen3-moe-tiny", "model_overrides": {"vocab_size": vocab_size}, "data": {"rows": str(rows)},
              "layout": {"max_tokens_per_gpu": 128}, "precision": "fp32", "steps": 2, "global_batch": 4,
              "run_dir": str(tmp_path / "run")}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"openrecipes train: error: data.rows: the rows in {rows} use token ids up to {largest:,}; model qwen3-moe-tiny's "
                       f"vocab_size is 512 (ids 0 to 511): build the rows with the model's tokenizer, or train a "
                       f"model whose vocabulary holds them (--set model_overrides.vocab_size={largest + 1})"], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_loop_checks_the_rows_it_loaded(make_recipe):
    from openrecipes.train.loop import train

    largest = int(np.max(load_rows(make_recipe().data.rows).input_ids))
    with pytest.raises(ValueError, match=rf"ids up to {largest:,}; model qwen3-moe-tiny's vocab_size is 256 "):
        train(make_recipe(model_overrides={"vocab_size": 256}), command="t")
