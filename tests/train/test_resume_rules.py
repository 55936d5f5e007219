"""A resume may change performance-only fields and steps; a numerics field is refused by name, and what changed is
recorded in the run directory."""

import json

import pytest
import yaml

from openrecipes.config.recipe import load_recipe
from openrecipes.train.loop import train


def _metrics(run_dir):
    return (run_dir / "metrics.jsonl").read_text()


@pytest.mark.parametrize("field, value", [("optimizer__lr", 1e-3), ("global_batch", 2), ("seed", 7),
                                          ("precision", "bf16")])
def test_a_numerics_change_on_resume_is_refused_by_name(make_recipe, tmp_path, field, value):
    run_dir = tmp_path / "run"
    train(make_recipe(run_dir=str(run_dir)), command="t", stop_after=1)
    before = _metrics(run_dir)
    changed = make_recipe(run_dir=str(run_dir), **{field: value})
    with pytest.raises(ValueError, match=field.replace("__", r"\.")):
        train(changed, command="t", resume=True)
    assert _metrics(run_dir) == before and not (run_dir / "resumes.jsonl").exists()


def test_performance_changes_and_more_steps_are_recorded(make_recipe, tmp_path):
    run_dir = tmp_path / "run"
    train(make_recipe(run_dir=str(run_dir)), command="t", stop_after=2)
    resumed = make_recipe(run_dir=str(run_dir), steps=8, layout__max_tokens_per_gpu=64)
    train(resumed, command="t", resume=True)
    [record] = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert record["step"] == 3
    assert record["changes"] == {"steps": [6, 8], "layout.max_tokens_per_gpu": [128, 64]}
    recorded = load_recipe(run_dir / "recipe.yaml")
    assert recorded.steps == 8 and recorded.layout.max_tokens_per_gpu == 64
    assert [json.loads(line)["step"] for line in _metrics(run_dir).splitlines()] == list(range(8))
    # RUN_DIR/recipe.yaml edited by hand (lr x10) is held to what the run started with (inputs.json), as --set is
    path = run_dir / "recipe.yaml"
    tree = yaml.safe_load(path.read_text())
    tree["optimizer"]["lr"] *= 10
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    with pytest.raises(ValueError, match=r"optimizer\.lr: 0\.003 -> 0\.03"):
        train(load_recipe(path), command="t", resume=True)
    assert len((run_dir / "resumes.jsonl").read_text().splitlines()) == 1


def test_train_recipe_and_resume_together_continue_the_run_or_name_what_differs(make_recipe, tmp_path, capsys,
                                                                               monkeypatch):
    """As TRL's resume_from_checkpoint beside its config: `train RECIPE --resume RUN_DIR` continues the run when
    RECIPE is the run's recipe but for performance-only fields and steps; otherwise one line names the fields."""
    from openrecipes.cli import main
    from openrecipes.config.recipe import dump_recipe

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run_dir = tmp_path / "run"
    recipe = make_recipe(run_dir=str(run_dir))
    train(recipe, command="t", stop_after=1)
    path = tmp_path / "recipe.yaml"  # the user's own copy, naming another run_dir: --resume says which run
    path.write_text(dump_recipe(recipe.model_copy(update={"run_dir": str(tmp_path / "elsewhere")})))
    capsys.readouterr()
    assert main(["train", str(path), "--resume", str(run_dir), "--set", "optimizer.lr=1e-3",
                 "--set", "seed=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optimizer.lr: 0.003 -> 0.001" in err and "seed: 0 -> 5" in err, err
    assert main(["train", str(path), "--resume", str(run_dir), "--set", "layout.max_tokens_per_gpu=64"]) == 0
    assert [json.loads(line)["step"] for line in _metrics(run_dir).splitlines()] == list(range(6))
    [record] = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert record == {"step": 2, "changes": {"layout.max_tokens_per_gpu": [128, 64]}}
    assert not (tmp_path / "elsewhere").exists()
