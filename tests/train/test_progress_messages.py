"""What `openrecipes train` says on stderr: the step counter from 1 to steps, the checkpoint it saved (and how to
resume from it), the checkpoint it resumes from; metrics.jsonl keeps 0-based steps."""

import re

import pytest
import torch
import yaml

from openrecipes.cli import main
from openrecipes.config.rundir import METRICS_FILE, read_metrics


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _recipe(tmp_path, rows_dir, steps: int):
    recipe = {"model": "qwen3-moe-tiny", "data": {"rows": str(rows_dir)}, "layout": {"max_tokens_per_gpu": 128},
              "precision": "fp32", "steps": steps, "global_batch": 4, "run_dir": str(tmp_path / "run"),
              "logging": {"progress": True}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, tmp_path / "run"


def _counters(err: str) -> list[str]:
    return re.findall(r"^step\s+(\d+/\d+)\s", err, flags=re.MULTILINE)


def test_stop_after_and_resume_say_which_checkpoint(tmp_path, rows_dir, capsys, one_thread):
    recipe, run_dir = _recipe(tmp_path, rows_dir, steps=2)
    assert main(["train", str(recipe), "--stop-after", "0"]) == 0
    err = capsys.readouterr().err
    assert _counters(err) == ["1/2"]
    assert f"saved step-000000 (resume with: openrecipes train --resume {run_dir})" in err

    assert main(["train", "--resume", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert "resuming from step-000000" in err
    assert _counters(err) == ["2/2"]
    saved = [line for line in err.splitlines() if "saved step-" in line]
    assert saved == ["openrecipes train: saved step-000001"]  # the run is finished: nothing to resume
    assert [record.step for record in read_metrics(run_dir / METRICS_FILE)] == [0, 1]
