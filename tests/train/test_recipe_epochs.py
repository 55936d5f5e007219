"""A recipe's epochs (Hugging Face's num_train_epochs) become whole optimizer steps over data.build.rows when the
recipe loads; steps and epochs together, or epochs without a rows count, are refused naming them."""

from pathlib import Path

import pytest

from openrecipes.config.epochs import steps_of_epochs
from openrecipes.config.recipe import dump_recipe, load_recipe, recipe_from_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"


@pytest.mark.parametrize("epochs, rows, global_batch, steps", [(1, 64, 8, 8), (2.5, 64, 8, 20), (1, 50, 8, 6),
                                                                (0.3, 10, 3, 1), (0.01, 64, 8, 1), (3, 6, 4, 4)])
def test_epochs_are_whole_steps_rounded_down(epochs, rows, global_batch, steps):
    assert steps_of_epochs(epochs, rows=rows, global_batch=global_batch) == steps
    assert steps * global_batch <= max(epochs * rows, global_batch)  # no row more often than asked (but one step)


def test_a_recipe_of_epochs_trains_their_steps_and_records_the_steps():
    recipe = load_recipe(EXAMPLE, ["steps=null", "epochs=1.5", "data.build.rows=40", "global_batch=4"])
    assert (recipe.steps, recipe.epochs) == (15, None)
    again = recipe_from_dict(__import__("yaml").safe_load(dump_recipe(recipe)))  # the run's recipe.yaml
    assert again == recipe


@pytest.mark.parametrize("sets, message", [
    (["epochs=2"], "give steps or epochs, not both (steps "),
    (["steps=null", "epochs=1", "data.build.rows=null"], "epochs needs the number of rows, data.build.rows"),
    (["steps=null", "epochs=0"], "epochs: Input should be greater than 0"),
])
def test_epochs_with_steps_or_without_a_rows_count_are_refused(sets, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_recipe(EXAMPLE, sets)


def test_every_tiny_example_reads_each_row_at_most_once():
    """The start banner warns when steps x global_batch exceed the rows; no example should start with a warning."""
    for path in sorted(EXAMPLE.parent.glob("tiny-*.yaml")):
        recipe = load_recipe(path, ["data.build.tokenizer=bundled"])
        rows = recipe.data.build.rows
        assert recipe.steps * recipe.global_batch <= rows, path.name
