"""The seed card's Qwen3-30B-A3B layout as a recipe: it loads, its layout is valid on 8 ranks, the engine accepts
it, and the planner says it fits an H200 with this engine's memory."""

from pathlib import Path

from openrecipes.models.registry import get_config
from openrecipes.config.layout import validate_layout
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.memory import TrainingSetup
from openrecipes.plan.shape import model_shape
from openrecipes.config.recipe import load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-8xh200.yaml"


def test_seed_layout_recipe_is_valid_and_fits():
    recipe = load_recipe(RECIPE)
    config = get_config(recipe.model)
    assert validate_layout(recipe.layout, world_size=8, model=model_shape(config).layout_model()) == [48]
    assert recipe.layout.ep == recipe.layout.dp == 8  # edp = 1: a layout the engine runs
    plan = evaluate(model_shape(config), recipe.layout,
                    TrainingSetup(recompute="full", optimizer="precision-aware", global_batch_tokens=128 * 8192,
                                  engine="openrecipes"), load_hardware("H200")).to_json()
    assert plan["fits"]
