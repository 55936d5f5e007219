"""Training checkpoints: nothing in one runs code, a damaged one is named, a poisoned one is never written."""

import pickle

import pytest

from openrecipes.cli import main
from openrecipes.train.checkpointing import latest_checkpoint
from openrecipes.train.loop import train
from tests.checkpoint.test_safe_load import RunsCode


@pytest.fixture()
def short_run(make_recipe):
    recipe = make_recipe(steps=2)
    return train(recipe, command="t", stop_after=0)


def test_train_resume_refuses_planted_metadata(short_run, tmp_path, capsys):
    marker = tmp_path / "ran"
    (latest_checkpoint(short_run) / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
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
    err = capsys.readouterr().err
    assert f"{shard}: damaged" in err and len(err.strip().splitlines()) == 1
