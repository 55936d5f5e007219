"""A run directory is new, empty or one `train` made; it never is, holds or sits inside what the run reads, and an
export of a run's save never replaces the model the run started from."""

import pytest
import torch
import yaml

from openrecipes.checkpoint.hf import save_hf
from openrecipes.cli import main
from openrecipes.config.recipe import dump_recipe
from openrecipes.config.rundir import RUN_MARKER, claim_run_dir
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config
from openrecipes.checkpoint.training_save import latest_checkpoint
from openrecipes.train.loop import train


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_recipe(path, recipe, **changes):
    tree = yaml.safe_load(dump_recipe(recipe))
    path.write_text(yaml.safe_dump({**tree, **changes}))
    return path


def listing(folder):
    return sorted((p.relative_to(folder).as_posix(), p.read_bytes() if p.is_file() else None)
                  for p in folder.rglob("*"))


@pytest.mark.parametrize("run_dir", ["..", "../..", "/", "a/../.."])
def test_a_run_dir_above_the_working_directory_is_refused_by_the_recipe(make_recipe, run_dir):
    with pytest.raises(ValueError, match="run_dir: .*one above it"):
        make_recipe(run_dir=run_dir)


def test_set_run_dir_to_the_parent_writes_nothing(make_recipe, tmp_path, monkeypatch, capsys):
    inner = tmp_path / "project"
    inner.mkdir()
    recipe = write_recipe(inner / "r.yaml", make_recipe(steps=1))
    monkeypatch.chdir(inner)
    before = listing(tmp_path)
    assert main(["train", str(recipe), "--set", "run_dir=.."]) == 2
    assert main(["train", str(recipe), "--set", f"run_dir={tmp_path}"]) == 2  # the same, named absolutely
    assert "run_dir: " in capsys.readouterr().err and listing(tmp_path) == before


def test_train_refuses_a_users_directory_holding_their_recipe(make_recipe, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    recipe = write_recipe(mine / "recipe.yaml", make_recipe(steps=1))
    before = listing(mine)
    assert main(["train", str(recipe), "--set", f"run_dir={mine}"]) == 2
    assert "run_dir: " in capsys.readouterr().err and listing(mine) == before
    assert main(["train", "--resume", str(mine)]) == 2  # its recipe.yaml alone does not make it a run directory
    assert "is not a run directory" in capsys.readouterr().err and listing(mine) == before


def test_a_users_recipe_and_run_json_do_not_make_a_run_directory(make_recipe, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    recipe = write_recipe(mine / "recipe.yaml", make_recipe(steps=1, run_dir=str(mine)))
    (mine / "run.json").write_text('{"experiment": "mine", "notes": "kept by hand"}\n')
    before = listing(mine)
    assert main(["train", str(recipe)]) == 2
    assert "run_dir: " in capsys.readouterr().err and listing(mine) == before
    assert main(["train", "--resume", str(mine)]) == 2
    assert listing(mine) == before


def test_train_refuses_a_populated_directory_it_did_not_make(make_recipe, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    recipe = write_recipe(tmp_path / "r.yaml", make_recipe(steps=1))
    assert main(["train", str(recipe), "--set", f"run_dir={other}"]) == 2
    assert f"has no {RUN_MARKER}" in capsys.readouterr().err and listing(other) == [("notes.txt", b"mine")]
    with pytest.raises(ValueError, match="run_dir: .*is not a run directory"):  # the library call keeps the rule
        train(make_recipe(steps=1, run_dir=str(other)), command="t")
    assert listing(other) == [("notes.txt", b"mine")]


def test_a_rows_folder_of_a_users_files_is_not_a_build_for_the_run(tmp_path):
    run = tmp_path / "run"
    (run / "rows").mkdir(parents=True)
    (run / "rows" / "mydata.txt").write_text("mine")  # no data build marker: the user's folder, not the run's rows
    with pytest.raises(ValueError, match=f"run_dir: .*is not a run directory .*has no {RUN_MARKER}"):
        claim_run_dir(run, [])
    assert sorted(p.name for p in run.iterdir()) == ["rows"]  # no marker left to claim the folder later
    (run / "rows" / "mydata.txt").unlink()
    assert claim_run_dir(run, []) == run and (run / RUN_MARKER).is_file()  # an empty rows folder is the run's


def test_a_run_dir_never_holds_or_sits_inside_what_the_run_reads(make_recipe, rows_dir, tmp_path):
    recipe = make_recipe(steps=1)
    with pytest.raises(ValueError, match="run_dir: .*sits inside the input"):
        claim_run_dir(rows_dir / "run", [rows_dir])
    with pytest.raises(ValueError, match="run_dir: .*is or holds the input"):
        claim_run_dir(rows_dir.parent, [rows_dir])
    assert not (rows_dir / "run").exists() and not (rows_dir.parent / RUN_MARKER).exists()
    with pytest.raises(ValueError, match="run_dir: .*sits inside the input"):  # what train itself passes
        train(recipe.model_copy(update={"run_dir": str(rows_dir / "run")}), command="t")


def test_an_empty_directory_is_trained_into_and_marked(make_recipe, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    recipe = write_recipe(tmp_path / "r.yaml", make_recipe(steps=1, checkpoint__at_end=False))
    assert main(["train", str(recipe), "--set", f"run_dir={empty}"]) == 0
    assert (empty / RUN_MARKER).is_file() and (empty / "metrics.jsonl").is_file()


def test_train_marks_its_run_and_one_from_before_the_marker_still_resumes(make_recipe):
    run_dir = train(make_recipe(steps=2), command="t", stop_after=0)
    assert (run_dir / RUN_MARKER).is_file()
    (run_dir / RUN_MARKER).unlink()  # run.json beside recipe.yaml: a run directory all the same
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert latest_checkpoint(run_dir).name == "step-000001" and (run_dir / RUN_MARKER).is_file()


def test_export_never_replaces_the_model_the_run_started_from(make_recipe, tmp_path, capsys):
    base = tmp_path / "base"  # an earlier export (it carries the export's marker), the model the run starts from
    save_hf(build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=3), base)
    before = listing(base)
    run_dir = train(make_recipe(model=str(base), init="checkpoint", steps=1), command="t")
    save = latest_checkpoint(run_dir)
    assert main(["convert", "export", str(save), str(base), "--overwrite"]) == 2
    assert "is or holds the input" in capsys.readouterr().err and listing(base) == before
    assert main(["convert", "export", str(save), str(save / "hf")]) == 2
    assert "sits inside the input" in capsys.readouterr().err
    assert main(["convert", "export", str(save), str(tmp_path / "exported")]) == 0


def test_a_run_refused_before_it_ran_leaves_no_directory(tmp_path, capsys):
    """The build of its rows fails (a tokenizer that is a file): the run directory this command made goes again,
    and the error names the recipe key; a run_dir under a file is refused by name."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"
    (tmp_path / "a-file").write_text("x")
    run_dir = tmp_path / "run"
    assert main(["train", str(example), "--set", f"run_dir={run_dir}", "--set",
                 f"data.build.tokenizer={tmp_path / 'a-file'}"]) == 2
    assert "error: data.build.tokenizer: " in capsys.readouterr().err and not run_dir.exists()
    assert main(["train", str(example), "--set", f"run_dir={tmp_path / 'a-file' / 'run'}"]) == 2
    assert "error: run_dir: " in (err := capsys.readouterr().err) and "which is a file, not a directory" in err
