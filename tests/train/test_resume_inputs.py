"""A resume is compared against what the run started with (RUN_DIR/inputs.json), not against the recipe.yaml it reads:
rows rebuilt in place, an edited base config.json and a numerics field edited in recipe.yaml are refused by name; a
performance-only edit is recorded. The run directory is made as a fresh start makes it (no training: fast)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from openrecipes.config.recipe import Recipe, dump_recipe, load_recipe
from openrecipes.config.rundir import INPUTS_FILE, RECIPE_FILE, RESUMES_FILE
from openrecipes.data.manifest import ROWS_FILE
from openrecipes.train.resume import record_inputs, record_resume, resumed_changes
from openrecipes.utils import sha256_file


def start(run_dir: Path, recipe: Recipe) -> None:
    """What a fresh start writes that a resume reads (train/loop.py)."""
    run_dir.mkdir(parents=True)
    (run_dir / RECIPE_FILE).write_text(dump_recipe(recipe))
    record_inputs(run_dir, recipe)


def edit_recipe_yaml(run_dir: Path, section: str, key: str, change) -> Recipe:
    """Edit RUN_DIR/recipe.yaml by hand, then read it as `train --resume RUN_DIR` does."""
    path = run_dir / RECIPE_FILE
    tree = yaml.safe_load(path.read_text())
    tree[section][key] = change(tree[section][key])
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return load_recipe(path)


@pytest.fixture()
def run(make_recipe, tmp_path):
    run_dir = tmp_path / "run"
    recipe = make_recipe(run_dir=str(run_dir))
    start(run_dir, recipe)
    return run_dir, recipe


def test_a_fresh_start_records_the_rows_the_base_config_and_the_resolved_recipe(make_recipe, rows_dir, tmp_path):
    from openrecipes.models.families import family_for_config
    from openrecipes.models.registry import get_config

    base = tmp_path / "base"  # the tiny model's Hugging Face directory; only its config.json is read here
    base.mkdir()
    config = get_config("qwen3-moe-tiny")
    (base / "config.json").write_text(json.dumps(family_for_config(config).config_to_hf(config), indent=2))
    run_dir = tmp_path / "run"
    recipe = make_recipe(run_dir=str(run_dir), model=str(base), init="checkpoint")
    start(run_dir, recipe)
    recorded = json.loads((run_dir / INPUTS_FILE).read_text())
    assert recorded["rows"]["parquet_sha256"] == sha256_file(rows_dir / ROWS_FILE)
    assert recorded["base_config"] == {"file": str(base / "config.json"), "sha256": sha256_file(base / "config.json")}
    assert recorded["recipe"]["resolved"] == recipe.model_dump(mode="json")
    assert resumed_changes(run_dir, load_recipe(run_dir / RECIPE_FILE)) == {}  # nothing changed: nothing refused

    # the base model's config.json edited after the start: the resume is refused naming the file
    config = json.loads((base / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"base config: .*base/config\.json has sha256 [0-9a-f]{64}, the run started "
                                         f"with {recorded['base_config']['sha256']}"):
        resumed_changes(run_dir, load_recipe(run_dir / RECIPE_FILE))


def test_a_numerics_field_edited_in_recipe_yaml_is_refused_by_name(run):
    run_dir, _ = run
    resumed = edit_recipe_yaml(run_dir, "optimizer", "lr", lambda lr: lr * 10)
    with pytest.raises(ValueError, match=r"optimizer\.lr: 0\.003 -> 0\.03"):
        resumed_changes(run_dir, resumed)
    assert not (run_dir / RESUMES_FILE).exists()


def test_a_performance_field_edited_in_recipe_yaml_is_recorded_once(run):
    run_dir, _ = run
    resumed = edit_recipe_yaml(run_dir, "layout", "max_tokens_per_gpu", lambda tokens: tokens // 2)
    changes = resumed_changes(run_dir, resumed)
    assert changes == {"layout.max_tokens_per_gpu": [128, 64]}
    record_resume(run_dir, resumed, changes, step=3)
    assert [json.loads(line) for line in (run_dir / RESUMES_FILE).read_text().splitlines()] == \
        [{"step": 3, "changes": changes}]
    # the record now holds the recipe as resumed: the next resume changes nothing, and lr is still held to it
    assert resumed_changes(run_dir, load_recipe(run_dir / RECIPE_FILE)) == {}
    with pytest.raises(ValueError, match=r"optimizer\.lr"):
        resumed_changes(run_dir, edit_recipe_yaml(run_dir, "optimizer", "lr", lambda lr: lr * 10))


def test_rows_rebuilt_in_place_are_refused(make_recipe, rows_dir, tmp_path):
    from openrecipes.config.recipe import DataBuild
    from openrecipes.data.build import build

    rows = tmp_path / "rows"
    shutil.copytree(rows_dir, rows)
    run_dir = tmp_path / "run"
    recipe = make_recipe(run_dir=str(run_dir), data={"rows": str(rows)})
    start(run_dir, recipe)
    before = sha256_file(rows / ROWS_FILE)
    # the same data.rows, built again with another seed: other rows, a manifest that agrees with them
    build(DataBuild(loss_mask="qwen3", row_tokens=64, rows=48, seed=2), rows, progress=False, overwrite=True)
    assert sha256_file(rows / ROWS_FILE) != before
    with pytest.raises(ValueError, match=f"rows: {rows} has parquet sha256 [0-9a-f]{{64}}, the run started on {before}"):
        resumed_changes(run_dir, load_recipe(run_dir / RECIPE_FILE))


def test_a_run_from_before_the_record_is_compared_against_its_recipe_yaml(run, make_recipe):
    run_dir, _ = run
    (run_dir / INPUTS_FILE).unlink()
    with pytest.raises(ValueError, match=r"optimizer\.lr: 0\.003 -> 0\.03"):
        resumed_changes(run_dir, make_recipe(run_dir=str(run_dir), optimizer__lr=0.03))
    assert resumed_changes(run_dir, make_recipe(run_dir=str(run_dir), steps=8)) == {"steps": [6, 8]}


def test_a_broken_record_is_one_line_naming_it(run):
    run_dir, recipe = run
    (run_dir / INPUTS_FILE).write_text('{"rows": {}}')
    with pytest.raises(ValueError, match=f"{run_dir / INPUTS_FILE}: expected an object with recipe.resolved"):
        resumed_changes(run_dir, recipe)
