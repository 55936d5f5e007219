"""An export copies the tokenizer files the rows' manifest names into HF_DIR under those names: a name that is not a
plain file name (``../../.bashrc``, an absolute path) is refused before anything is written, by `convert export` and
by ``checkpoint.export_hf`` at the end of `train` alike."""

import hashlib
import json
import shutil

import pytest

from openrecipes.cli import main
from openrecipes.data.bundled import TOKENIZER
from openrecipes.checkpoint.training_save import latest_checkpoint
from openrecipes.train.loop import train

PLANTED = "export this\n"


def _rows_naming(rows_dir, tmp_path, name):
    """A copy of the rows whose manifest lists one more tokenizer file, ``name``, with the sha256 of PLANTED; the
    tokenizer directory is tmp_path/tok/a/b, and tmp_path/tok/planted.txt holds PLANTED."""
    rows, tokenizer = tmp_path / "rows", tmp_path / "tok" / "a" / "b"
    shutil.copytree(rows_dir, rows)
    shutil.copytree(TOKENIZER, tokenizer)
    (tmp_path / "tok" / "planted.txt").write_text(PLANTED)
    manifest = json.loads((rows / "manifest.json").read_text())
    manifest["tokenizer"]["directory"] = str(tokenizer)
    manifest["tokenizer"]["files_sha256"][name] = hashlib.sha256(PLANTED.encode()).hexdigest()
    (rows / "manifest.json").write_text(json.dumps(manifest))
    return rows


def test_a_tokenizer_name_climbing_out_is_refused_by_convert_export(make_recipe, rows_dir, tmp_path, capsys):
    rows = _rows_naming(rows_dir, tmp_path, "../../planted.txt")
    run_dir = train(make_recipe(steps=1, data__rows=str(rows)), command="test")
    out = tmp_path / "exp" / "x" / "hf"  # its staging directory's ../../ is tmp_path/exp
    assert main(["convert", "export", str(latest_checkpoint(run_dir)), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{rows / 'manifest.json'}: tokenizer.files_sha256: '../../planted.txt' is not a file name" in err
    assert not (tmp_path / "exp" / "planted.txt").exists() and not out.exists()


def test_an_absolute_tokenizer_name_is_not_rewritten_in_place(make_recipe, rows_dir, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text(PLANTED)
    before = victim.stat()
    rows = _rows_naming(rows_dir, tmp_path, str(victim))
    run_dir = train(make_recipe(steps=1, data__rows=str(rows)), command="test")
    assert main(["convert", "export", str(latest_checkpoint(run_dir)), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"tokenizer.files_sha256: '{victim}' is not a file name" in err and "an absolute path" in err
    after = victim.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not replaced
    assert not (tmp_path / "hf").exists()


def test_train_refuses_the_name_when_it_exports_at_the_end(make_recipe, rows_dir, tmp_path):
    rows = _rows_naming(rows_dir, tmp_path, "../../planted.txt")
    recipe = make_recipe(steps=1, data__rows=str(rows), checkpoint__export_hf=True)
    with pytest.raises(ValueError, match=r"manifest\.json: tokenizer\.files_sha256: '\.\./\.\./planted\.txt' is not"):
        train(recipe, command="test")
    assert not (tmp_path / "planted.txt").exists()  # RUN_DIR/hf's staging directory's ../../
    assert not (tmp_path / "run" / "hf").exists() and latest_checkpoint(tmp_path / "run") is not None
