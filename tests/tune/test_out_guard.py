"""What the tuner refuses before anything runs: an --out a marker file does not make fillable (apart from its start
recipe, never a link, never the working directory; a directory an earlier run marked is reused), and --max-parallel
outside Slurm or below 1."""

import os

import pytest

from openrecipes.tune.journal import MARKER, prepare_out


def _marked(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("x")
    return path


def test_a_marked_directory_is_reused(tmp_path):
    start = tmp_path / "start.yaml"
    start.write_text("name: x\n")
    out = _marked(tmp_path / "out")
    (out / "trials.jsonl").write_text("")
    prepare_out(out, start)
    assert (out / "trials.jsonl").is_file()


def test_a_marked_directory_holding_the_start_recipe_is_refused(tmp_path):
    out = _marked(tmp_path / "out")
    start = out / "start.yaml"
    start.write_text("name: x\n")
    with pytest.raises(ValueError, match="holds the input"):
        prepare_out(out, start)


def test_a_marked_link_or_working_directory_is_refused(tmp_path, monkeypatch):
    start = tmp_path / "start.yaml"
    start.write_text("name: x\n")
    real = _marked(tmp_path / "real")
    link = tmp_path / "link"
    os.symlink(real, link)
    with pytest.raises(ValueError, match="symbolic link"):
        prepare_out(link, start)
    here = _marked(tmp_path / "here")
    monkeypatch.chdir(here)
    with pytest.raises(ValueError, match="current directory"):
        prepare_out(here, start)


@pytest.mark.parametrize("argv, message", [
    (["--max-parallel", "2"], "--max-parallel 2: trials run one at a time on this machine"),
    (["--max-parallel", "0", "--slurm", "1"], "--max-parallel: K must be >= 1, got 0"),
])
def test_max_parallel_is_refused_before_anything_runs(tmp_path, capsys, argv, message):
    from openrecipes.cli import main

    start = tmp_path / "start.yaml"
    start.write_text("name: x\n")
    assert main(["tune", str(start), "--gpus", "cpu", "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
