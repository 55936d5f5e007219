"""Image-text SFT under layouts against one process: fp32, gloo, two processes each. DP2-EP2: FSDP2 shards the
frozen vision tower with the other dense weights, each rank encodes the images of its own rows, and the experts are
split over expert parallelism (built on the meta device, the tower materialised with one process's values). CP2: each rank holds half of every
row, its positions cut from the whole rows' and the features of exactly its image tokens (an image the cut splits
shares its tokens; tests/train/test_image_training.py checks that split in-process). PP2: the first stage runs the
towers and the layers DeepStack feeds, its images travelling padded per row through the schedule, the whole rows'
positions to every stage. Muse Spark (examples/tiny-muse-spark-image-sft.yaml, vision and audio towers frozen) under
DP2-EP2 as well. Losses and gradient norms equal one process's. The layouts image rows do not run yet are refused
before any step (test_image_training.py)."""

from pathlib import Path

import pytest

from tests.distributed.test_layouts import assert_same, metrics, train_metrics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "tiny-qwen3-vl-moe-sft.yaml"
MUSE_SPARK = EXAMPLES / "tiny-muse-spark-image-sft.yaml"
COMMON = ["steps=2", "logging.progress=false", "checkpoint.every=null", "checkpoint.at_end=false",
          "data.build.rows=8"]
LAYOUTS = {"DP2-EP2": ["layout.dp=2", "layout.ep=2"], "CP2": ["layout.dp=1", "layout.cp=2"],
           "PP2": ["layout.dp=1", "layout.pp=2", "layout.pp_first_stage_layers=2", "layout.max_tokens_per_gpu=128"]}


def _train(run_dir, nproc, *sets, example=EXAMPLE):
    return train_metrics(run_dir, *sets, nproc=nproc, example=example, common=COMMON)


def _one_process(run_dir, example=EXAMPLE):
    """The reference in this process (a third torchrun start would double the test's time)."""
    from openrecipes.config.recipe import load_recipe
    from openrecipes.config.rundir import rows_directory
    from openrecipes.data.build import build_recipe_rows
    from openrecipes.train.loop import train

    recipe = load_recipe(example, [*COMMON, f"run_dir={run_dir}"])
    build_recipe_rows(recipe.data.build, rows_directory(None, recipe.run_dir))
    train(recipe, command="t")
    return metrics(run_dir)


@pytest.mark.slow
def test_image_rows_under_layouts_match_one_process(tmp_path):
    one = _one_process(tmp_path / "one")
    for label, sets in LAYOUTS.items():
        assert_same(_train(tmp_path / label, 2, *sets), one)
    muse = _one_process(tmp_path / "muse-one", MUSE_SPARK)
    assert_same(_train(tmp_path / "muse-DP2-EP2", 2, *LAYOUTS["DP2-EP2"], example=MUSE_SPARK), muse)
