"""Training checkpoints: nothing in one runs code, a damaged one is named, a poisoned one is never written."""

import pytest

from openrecipes.cli import main
from openrecipes.checkpoint.training_save import latest_checkpoint
from openrecipes.train.loop import train
from tests.checkpoint.test_safe_load import plant_metadata


@pytest.fixture()
def short_run(make_recipe):
    recipe = make_recipe(steps=2)
    return train(recipe, command="t", stop_after=0)


def test_train_resume_refuses_planted_metadata(short_run, tmp_path, capsys):
    marker = tmp_path / "ran"
    plant_metadata(latest_checkpoint(short_run), marker)
    assert main(["train", "--resume", str(short_run)]) == 2
    assert "refused to load" in capsys.readouterr().err
    assert not marker.exists()


def test_a_real_training_checkpoint_resumes(short_run):
    assert main(["train", "--resume", str(short_run)]) == 0
    assert latest_checkpoint(short_run).name == "step-000001"


@pytest.mark.parametrize("setting,field", [
    ("optimizer.lr=.inf", "optimizer.lr"), ("optimizer.lr=1e400", "optimizer.lr"),
    ("optimizer.lr=5.0", "optimizer.lr"), ("optimizer.betas=[0.9, 1.0]", "optimizer.betas.1"),
    ("optimizer.eps=0", "optimizer.eps"), ("optimizer.weight_decay=.nan", "optimizer.weight_decay"),
    ("optimizer.grad_clip=.inf", "optimizer.grad_clip"), ("optimizer.min_lr=0.5", "min_lr"),
])
def test_absurd_hyperparameters_are_refused_by_name(tmp_path, setting, field):
    from openrecipes.config.recipe import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text("model: qwen3-moe-tiny\ndata: {rows: /nowhere}\nlayout: {max_tokens_per_gpu: 128}\n"
                    "steps: 3\nglobal_batch: 4\noptimizer: {lr: 0.001}\n")
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_recipe(path, [setting])


def test_a_nonfinite_state_is_never_saved(make_recipe, monkeypatch):
    import torch

    from openrecipes.optim.adam import MixedPrecisionAdam

    real_step, calls = MixedPrecisionAdam.step, {"n": 0}

    def poisoning_step(self, *args, **kwargs):  # the update of step 2 turns one weight into NaN
        result = real_step(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(MixedPrecisionAdam, "step", poisoning_step)
    recipe = make_recipe(checkpoint__every=1, checkpoint__keep=5)
    with pytest.raises(ValueError, match="step 2: .* holds non-finite values; checkpoint step-000002 was not"):
        train(recipe, command="t")
    assert latest_checkpoint(recipe.run_dir).name == "step-000001"


def test_skipping_nonfinite_steps_stops_when_they_keep_coming(make_recipe, monkeypatch):
    from openrecipes.train import engine
    from openrecipes.train.loop import TrainingStopped

    real = engine.microbatch_loss_sum

    def poisoned(*args, **kwargs):
        return real(*args, **kwargs) * float("nan")  # every step from the first

    monkeypatch.setattr(engine, "microbatch_loss_sum", poisoned)
    recipe = make_recipe(steps=6, debug__skip_nonfinite_steps=True, debug__max_consecutive_skips=2)
    with pytest.raises(TrainingStopped, match=r"step 2: non-finite .* after 2 skipped steps in a row"):
        train(recipe, command="t")


def test_a_damaged_training_checkpoint_is_named_on_resume(short_run, capsys):
    shard = next(latest_checkpoint(short_run).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    assert main(["train", "--resume", str(short_run)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and f"{shard}: damaged" in errors[0]


def test_pruning_keeps_the_new_save_beside_a_leftover_higher_numbered_one(make_recipe):
    import shutil

    recipe = make_recipe(steps=6, checkpoint__every=2, checkpoint__keep=1)
    run_dir = train(recipe, command="t", stop_after=1)
    root = run_dir / "checkpoints"
    shutil.copytree(root / "step-000001", root / "step-000009")  # left over from an earlier attempt
    train(recipe, command="t", resume=True)
    assert latest_checkpoint(run_dir).name == "step-000005"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-000005"]
    assert main(["train", "--resume", str(run_dir)]) == 0  # what `latest` names is there to resume from


def test_a_save_completed_before_latest_was_written_is_used(make_recipe, monkeypatch, tmp_path):
    from openrecipes.checkpoint import training_save as checkpointing

    whole = train(make_recipe(steps=6, checkpoint__every=2, run_dir=str(tmp_path / "whole")), command="t")
    recipe = make_recipe(steps=6, checkpoint__every=2)
    real_write, calls = checkpointing.atomic_write_text, {"latest": 0}

    def killed_before_latest(path, text):
        if path.name == checkpointing.LATEST:
            calls["latest"] += 1
            if calls["latest"] == 2:  # the save of step 3: renamed into place, then the process died
                raise KeyboardInterrupt
        return real_write(path, text)

    monkeypatch.setattr(checkpointing, "atomic_write_text", killed_before_latest)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, command="t")
    monkeypatch.undo()
    root = checkpointing.Path(recipe.run_dir) / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-000001" and (root / "step-000003").is_dir()
    assert latest_checkpoint(recipe.run_dir).name == "step-000003"
    train(recipe, command="t", resume=True)
    from tests.train.test_loop import losses

    assert [r["loss"] for r in losses(root.parent)] == [r["loss"] for r in losses(whole)]


def test_leftover_staging_directories_are_removed_and_nothing_else(short_run, make_recipe):
    root = short_run / "checkpoints"
    (root / ".step-000007.partial").mkdir()
    (root / "notes.partial").mkdir()  # not a name the trainer writes
    train(make_recipe(steps=2), command="t", resume=True)
    assert not (root / ".step-000007.partial").exists() and (root / "notes.partial").is_dir()


def test_a_kill_during_the_first_save_leaves_a_run_that_resumes_or_starts_again(make_recipe, monkeypatch):
    from pathlib import Path

    from openrecipes.checkpoint import training_save as checkpointing
    from tests.train.test_loop import losses

    recipe = make_recipe(steps=2)
    run_dir = Path(recipe.run_dir)
    real_save = checkpointing.dcp.save

    def killed(state, checkpoint_id):  # what a kill mid-write leaves: part of the files, no rename, no `latest`
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
        raise OSError("killed during the first save")

    for restart in ("resume", "fresh"):
        monkeypatch.setattr(checkpointing.dcp, "save", killed)
        with pytest.raises(OSError):
            train(recipe, command="t")
        monkeypatch.setattr(checkpointing.dcp, "save", real_save)
        first = [r["loss"] for r in losses(run_dir)]
        assert (run_dir / "checkpoints" / ".step-000001.partial").is_dir() and latest_checkpoint(run_dir) is None
        (run_dir / "notes.txt").write_text("mine")  # not the tool's: kept
        (run_dir / "resumes.jsonl").write_text('{"step": 0, "changes": {}}\n')  # an earlier resume's record
        train(recipe, command="t", resume=restart == "resume")
        assert (run_dir / "resumes.jsonl").exists() == (restart == "resume")  # a fresh start is a new run
        assert latest_checkpoint(run_dir).name == "step-000001"
        assert not (run_dir / "checkpoints" / ".step-000001.partial").exists()
        assert [r["loss"] for r in losses(run_dir)] == first  # from step 0 again: the same two steps, once each
        assert (run_dir / "notes.txt").read_text() == "mine"
        (run_dir / "checkpoints" / "step-000001").rename(run_dir / "checkpoints" / f"kept-{restart}")
        (run_dir / "checkpoints" / "latest").unlink()  # the next round starts from a run that never saved again
    # a run that did save is still never started over
    (run_dir / "checkpoints" / "kept-fresh").rename(run_dir / "checkpoints" / "step-000001")
    with pytest.raises(ValueError, match="already holds a run"):
        train(recipe, command="t")


@pytest.mark.parametrize("content", ["../../outside", "/etc", "step-000000/../../x", "rows"])
def test_latest_naming_anything_outside_the_run_is_refused(short_run, content, capsys):
    (short_run / "checkpoints" / "latest").write_text(content + "\n")
    with pytest.raises(ValueError, match="not a checkpoint directory of this run"):
        latest_checkpoint(short_run)
    assert main(["train", "--resume", str(short_run)]) == 2
    assert "not a checkpoint directory of this run" in capsys.readouterr().err


@pytest.mark.parametrize("run_dir", ["", "  ", "."])
def test_an_empty_run_dir_is_refused(make_recipe, run_dir):
    with pytest.raises(ValueError, match="run_dir: .*must name a directory"):
        make_recipe(run_dir=run_dir)


def test_train_says_the_absolute_path_it_writes(make_recipe, monkeypatch, tmp_path, capsys):
    import yaml

    from openrecipes.config.recipe import dump_recipe

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "recipe.yaml"
    tree = yaml.safe_load(dump_recipe(make_recipe(steps=1)))
    path.write_text(yaml.safe_dump({**tree, "run_dir": "relative/run"}))
    assert main(["train", str(path)]) == 0
    assert f"writing to {tmp_path / 'relative' / 'run'}" in capsys.readouterr().err
