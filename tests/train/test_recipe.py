"""Recipe loading: overrides, and errors that name the key."""

import pytest

from openrecipes.cli import main
from openrecipes.config.overrides import apply_overrides
from openrecipes.config.recipe import load_recipe


def write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


BASE = """
model: qwen3-moe-tiny
data: {rows: /nowhere}
layout: {max_tokens_per_gpu: 128}
steps: 3
global_batch: 4
"""


def test_overrides_are_typed_and_nested(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["layout.dp=2", "optimizer.lr=1e-4", "precision=fp32"])
    assert recipe.layout.dp == 2 and recipe.optimizer.lr == 1e-4 and recipe.precision == "fp32"


@pytest.mark.parametrize("extra,field", [
    ("optimiser: {lr: 1}", "optimiser"),
    ("layout: {max_tokens_per_gpu: 128, tp: 0}", "layout.tp"),
    ("recompute: {granularity: sometimes}", "recompute.granularity"),
    ("offload: {fraction: 2}", "offload.fraction"),
])
def test_bad_values_name_the_key(tmp_path, extra, field):
    text = BASE.replace("layout: {max_tokens_per_gpu: 128}\n", "") + extra + "\n"
    if "layout" not in extra:
        text += "layout: {max_tokens_per_gpu: 128}\n"
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_recipe(write(tmp_path, text))


@pytest.mark.parametrize("override, field", [("steps=true", "steps"), ("layout.tp=true", "layout.tp"),
                                             ("optimizer.lr=false", "optimizer.lr"),
                                             ("checkpoint.every=true", "checkpoint.every"),
                                             ("data.build.row_tokens=true", "data.build.row_tokens")])
def test_a_boolean_for_a_number_is_refused_by_the_key(tmp_path, override, field):
    """pydantic would read true as 1: one step, one rank, a learning rate of 1."""
    sets = ["data.rows=null", "data.build={row_tokens: 64}"] if field.startswith("data.build") else []
    with pytest.raises(ValueError, match=rf"{field.replace('.', chr(92) + '.')}: expected a number, got "
                                         rf"{override.split('=')[1]}"):
        load_recipe(write(tmp_path, BASE), [*sets, override])
    assert load_recipe(write(tmp_path, BASE), ["logging.progress=false"]).logging.progress is False


def test_override_syntax_errors():
    with pytest.raises(ValueError, match="KEY=VALUE"):
        apply_overrides({}, ["layout.dp"])


def test_cli_reports_the_key_and_exits_2(tmp_path, capsys):
    assert main(["train", str(write(tmp_path, BASE)), "--set", "steps=0"]) == 2
    assert "steps" in capsys.readouterr().err


def test_example_recipe_loads():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"
    recipe = load_recipe(example)
    assert recipe.optimizer_master() == "remainder"


@pytest.mark.parametrize("override, hint", [
    ("optimzer.lr=1e-3", "optimzer: Extra inputs are not permitted (did you mean 'optimizer'?)"),
    ("checkpoint.evry=2", "checkpoint.evry: Extra inputs are not permitted (did you mean 'every'?)"),
    ("data.build.row_token=8", "data.build.row_token: Extra inputs are not permitted (did you mean 'row_tokens'?)"),
])
def test_an_unknown_key_suggests_the_closest_valid_one(override, hint):
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"
    with pytest.raises(ValueError) as error:
        load_recipe(example, [override])
    assert str(error.value).endswith(hint)
