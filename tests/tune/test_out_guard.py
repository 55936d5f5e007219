"""The tuner's --out: a directory an earlier run marked is reused, but a marker file makes no directory one the
tuner may fill (apart from its start recipe, never a link, never the working directory)."""

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
