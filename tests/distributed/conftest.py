"""Fixtures shared by the one-rank tests (test_rank_measure.py, test_rank_replay.py)."""

from pathlib import Path

import pytest

TINY_QWEN3 = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The tiny Qwen3 recipe's rows, built once per test module for every rank it measures or replays."""
    from openrecipes.config.recipe import load_recipe
    from openrecipes.config.rundir import rows_directory
    from openrecipes.data.build import build_recipe_rows

    run = tmp_path_factory.mktemp("ranks") / "run"
    recipe = load_recipe(TINY_QWEN3, [f"run_dir={run}"])
    build_recipe_rows(recipe.data.build, rows_directory(None, recipe.run_dir))
    return run
