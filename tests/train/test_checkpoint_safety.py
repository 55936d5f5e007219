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
