"""examples/tiny-qwen3-real-tokenizer.yaml: the tiny model on the real Qwen3 tokenizer trains on a CPU in fp32, its
vocabulary holding every id of the tokenizer, with neither the bf16-on-CPU note nor a warning about repeated rows."""

from pathlib import Path

from openrecipes.cli import main
from openrecipes.config.recipe import load_recipe

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-real-tokenizer.yaml"


def test_the_example_trains_the_tiny_model_on_a_real_tokenizer(qwen3_reference, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    recipe = load_recipe(EXAMPLE, [f"data.build.tokenizer={qwen3_reference.directory}"])
    assert recipe.precision == "fp32" and recipe.steps * recipe.global_batch == recipe.data.build.rows  # one epoch
    assert len(qwen3_reference.hf) <= recipe.model_overrides["vocab_size"]  # every id of the tokenizer has a row
    sets = [f"data.build.tokenizer={qwen3_reference.directory}", "data.build.rows=4", "data.build.row_tokens=64",
            "global_batch=2", f"run_dir={tmp_path / 'run'}", "logging.progress=false"]
    assert main(["train", str(EXAMPLE), *[item for s in sets for item in ("--set", s)]]) == 0
    err = capsys.readouterr().err
    assert "4 rows of 64 tokens; 2 steps x 2 rows cover 1.00 epoch(s)" in err
    assert "warning" not in err and "note:" not in err, err
