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
    (["--max-parallel", "0", "--slurm", "1"], "argument --max-parallel: 0 is not an integer >= 1"),
    # numbers checked when they are parsed, before a start trial runs: NaN would disable the limit it sets
    (["--trial-timeout", "nan"], "argument --trial-timeout: nan is not a finite number > 0"),
    (["--trial-timeout", "0"], "argument --trial-timeout: 0 is not a finite number > 0"),
    (["--trial-timeout", "-1"], "argument --trial-timeout: -1 is not a finite number > 0"),
    (["--minutes", "0"], "argument --minutes: 0 is not a finite number > 0"),
    (["--minutes", "-5"], "argument --minutes: -5 is not a finite number > 0"),
    (["--minutes", "nan"], "argument --minutes: nan is not a finite number > 0"),
    (["--minutes", "inf"], "argument --minutes: inf is not a finite number > 0"),
    (["--nproc", "0"], "argument --nproc: 0 is not an integer >= 1"),
    (["--stable-cv", "nan"], "argument --stable-cv: nan is not a finite number >= 0"),
    (["--remeasure", "-1"], "argument --remeasure: -1 is not an integer >= 0"),
    (["--slurm", "1", "--slurm-poll-seconds", "nan"], "argument --slurm-poll-seconds: nan is not a finite number > 0"),
])
def test_options_are_refused_before_anything_runs(tmp_path, capsys, argv, message):
    from openrecipes.cli import main

    start = tmp_path / "start.yaml"
    start.write_text("name: x\n")
    try:
        status = main(["tune", str(start), "--gpus", "cpu", "--out", str(tmp_path / "out"), *argv])
    except SystemExit as refused:  # argparse's refusal of an option's value
        status = refused.code
    assert status == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("given, words", [
    ("garbage", "expected KEY=VALUE"), ("nosuch=1", "nosuch"),
    ("optimizer.lr=0.1", "numerics"), ("layout.ep=3", "openrecipes train refuses its layout")])
def test_a_try_that_cannot_run_is_refused_before_any_trial(start_yaml, tmp_path, capsys, given, words):
    from openrecipes.cli import main

    out = tmp_path / "tune"
    status = main(["tune", str(start_yaml), "--gpus", "cpu", "--minutes", "5", "--trials", "2", "--trial-steps", "3",
                   "--try", given, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err[-1].startswith(f"openrecipes tune: error: --try {given!r}: ") and words in err[-1], err
    trials = out / "trials.jsonl"
    assert not trials.exists() or trials.read_text() == ""  # not even the start ran


def test_rows_a_card_cannot_describe_are_refused_before_any_trial(rows_dir, tmp_path, capsys):
    """The card reads the rows' manifest at the end; a manifest it cannot read (here without the build's name) is
    refused by file and field before the start runs, not after the whole search."""
    import json
    import shutil

    from openrecipes.cli import main
    from tests.tune.conftest import write_start

    rows = tmp_path / "rows"
    shutil.copytree(rows_dir, rows)
    manifest = json.loads((rows / "manifest.json").read_text())
    del manifest["name"]
    (rows / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "tune"
    status = main(["tune", str(write_start(tmp_path / "start.yaml", rows)), "--gpus", "cpu", "--minutes", "5",
                   "--trials", "2", "--trial-steps", "3", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err[-1] == f"openrecipes tune: error: {rows / 'manifest.json'}: missing field 'name'", err
    trials = out / "trials.jsonl"
    assert not trials.exists() or trials.read_text() == ""
