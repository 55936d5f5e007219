"""--overwrite replaces only an earlier output of the same verb: never the input, the working directory or a
directory the tool did not write."""

import os
import shutil

import pytest

from openrecipes.checkpoint.hf import save_hf
from openrecipes.cli import main
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config
from openrecipes.utils import check_output_dir, check_output_file, guarded_output_dir
from tests.data.sft_data_helpers import BUNDLED_CONVERSATIONS, BUNDLED_TOKENIZER


def data_build(input_path, out, *extra):
    return main(["data", "build", str(input_path), "--tokenizer", str(BUNDLED_TOKENIZER), "--loss-mask", "qwen3",
                 "--row-tokens", "64", "--rows", "2", "--no-progress", "--out", str(out), *extra])


@pytest.fixture()
def dataset(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(BUNDLED_CONVERSATIONS, folder / "conversations.jsonl")
    (folder / "notes.txt").write_text("mine")
    return folder / "conversations.jsonl"


def assert_untouched(dataset):
    assert dataset.read_bytes() == BUNDLED_CONVERSATIONS.read_bytes()
    assert (dataset.parent / "notes.txt").read_text() == "mine"


def test_data_build_refuses_the_working_directory(dataset, monkeypatch, capsys):
    monkeypatch.chdir(dataset.parent)
    assert data_build("conversations.jsonl", ".", "--overwrite") == 2
    assert "current directory" in capsys.readouterr().err
    assert_untouched(dataset)


def test_data_build_refuses_the_input_directory(dataset, capsys):
    assert data_build(dataset, dataset.parent, "--overwrite") == 2
    assert "holds the input" in capsys.readouterr().err
    assert_untouched(dataset)


def test_data_build_refuses_an_unmarked_directory(dataset, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert data_build(dataset, other, "--overwrite") == 2
    assert "was not written by openrecipes data build" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "x"


def test_data_build_replaces_its_own_output_and_nothing_else(dataset, tmp_path, capsys):
    out = tmp_path / "rows"
    assert data_build(dataset, out) == 0
    assert data_build(dataset, out) == 2  # without --overwrite
    (out / "notes").mkdir()
    (out / "notes" / "mine.txt").write_text("kept")  # a file of the user's, beside what the build wrote
    assert data_build(dataset, out, "--overwrite") == 2
    assert "holds 'notes', which openrecipes data build did not write" in capsys.readouterr().err
    assert (out / "notes" / "mine.txt").read_text() == "kept"
    shutil.rmtree(out / "notes")
    before = (out / "manifest.json").stat().st_mtime_ns
    assert data_build(dataset, out, "--overwrite") == 0
    assert (out / "manifest.json").stat().st_mtime_ns != before


def test_a_failed_write_leaves_no_folder_it_made(tmp_path):
    out = tmp_path / "a" / "b" / "rows"
    with pytest.raises(RuntimeError):
        with guarded_output_dir(out, marker=".m", writer="w"):
            raise RuntimeError("the build failed")
    assert list(tmp_path.iterdir()) == []


def test_a_terminated_write_leaves_no_staging_directory(tmp_path):
    """SIGTERM (a job's time limit, kill) while the output is staged: the staging directory goes, exit 143."""
    import signal
    import subprocess
    import sys
    import time

    script = ("import sys, time\nfrom openrecipes.utils import guarded_output_dir\n"
              "with guarded_output_dir(sys.argv[1], marker='.m', writer='w') as staging:\n"
              "    (staging / 'rows.parquet').write_text('half')\n    print('staged', flush=True)\n"
              "    time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "rows")], stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "staged"
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def hf_dir(tmp_path):
    save_hf(build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=1), tmp_path / "hf")
    return tmp_path / "hf"


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_convert_refuses_source_as_destination(hf_dir, tmp_path, capsys):
    before = snapshot(hf_dir)
    assert main(["convert", "import", str(hf_dir), str(hf_dir), "--overwrite"]) == 2
    assert "holds the input" in capsys.readouterr().err and snapshot(hf_dir) == before
    native = tmp_path / "native"
    assert main(["convert", "import", str(hf_dir), str(native)]) == 0
    native_before = snapshot(native)
    assert main(["convert", "export", str(native), str(native), "--overwrite"]) == 2
    assert main(["convert", "export", str(native / "sub"), str(native), "--overwrite"]) == 2  # holds the input
    assert snapshot(native) == native_before


def test_convert_overwrites_only_its_own_output(hf_dir, tmp_path, capsys):
    native, back = tmp_path / "native", tmp_path / "back"
    assert main(["convert", "import", str(hf_dir), str(native)]) == 0
    assert main(["convert", "import", str(hf_dir), str(native), "--overwrite"]) == 0
    assert main(["convert", "export", str(native), str(back)]) == 0
    (back / "stale.txt").write_text("old")  # not the export's: --overwrite leaves it, and the directory, alone
    assert main(["convert", "export", str(native), str(back), "--overwrite"]) == 2
    assert "holds 'stale.txt', which openrecipes (Hugging Face export) did not write" in capsys.readouterr().err
    assert (back / "stale.txt").read_text() == "old"
    (back / "stale.txt").unlink()
    assert main(["convert", "export", str(native), str(back), "--overwrite"]) == 0
    # a directory someone else wrote is not replaced, even with --overwrite
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    assert main(["convert", "export", str(native), str(foreign), "--overwrite"]) == 2
    assert main(["convert", "import", str(hf_dir), str(foreign), "--overwrite"]) == 2
    assert "was not written by" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["config.json"]


def test_guard_refuses_ancestors_of_the_working_directory_links_and_files(tmp_path, monkeypatch):
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    monkeypatch.chdir(inner)
    with pytest.raises(ValueError, match="current directory"):
        check_output_dir(tmp_path / "a", marker=".m", writer="w", overwrite=True)
    (tmp_path / "a" / ".m").write_text("")  # even a marked one: the shell would be left in a deleted directory
    with pytest.raises(ValueError, match="current directory"):
        check_output_dir(tmp_path / "a", marker=".m", writer="w", overwrite=True)
    os.symlink(tmp_path / "a", tmp_path / "link")
    with pytest.raises(ValueError, match="symbolic link"):
        check_output_dir(tmp_path / "link", marker=".m", writer="w", overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        check_output_dir(tmp_path / "file", marker=".m", writer="w", overwrite=True)


def test_guarded_output_leaves_the_marker(tmp_path):
    with guarded_output_dir(tmp_path / "out", marker=".m", writer="w") as staging:
        (staging / "x").write_text("1")
    assert (tmp_path / "out" / ".m").is_file()
    with guarded_output_dir(tmp_path / "out", marker=".m", writer="w", overwrite=True) as staging:
        (staging / "y").write_text("2")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".m", "y"]


@pytest.mark.parametrize("marker_text", ["", "written by w\n", "x\ny\n"])
def test_a_marker_that_lists_nothing_replaces_nothing(tmp_path, marker_text):
    out = tmp_path / "out"  # an older version's marker, or one a user made: which files are ours is unknown
    out.mkdir()
    (out / ".m").write_text(marker_text)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"out/\.m does not list what w wrote there") as error:
        with guarded_output_dir(out, marker=".m", writer="w", overwrite=True) as staging:
            (staging / "y").write_text("2")
    assert "\n" not in str(error.value) and (out / "notes.txt").read_text() == "mine"
    check_output_dir(out, marker=".m", writer="w", overwrite=True, reused=True)  # a writer that only adds files


def test_a_listing_marker_with_nothing_listed_still_guards_what_came_later(tmp_path):
    with guarded_output_dir(tmp_path / "out", marker=".m", writer="w"):
        pass  # an empty output: its marker lists nothing
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds 'notes.txt', which w did not write"):
        check_output_dir(tmp_path / "out", marker=".m", writer="w", overwrite=True)


def test_an_output_inside_an_input_is_refused_and_paths_are_compared_resolved(tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    with pytest.raises(ValueError, match="sits inside the input"):
        check_output_dir(source / "out", marker=".m", writer="w", overwrite=False, inputs=[source])
    os.symlink(tmp_path, tmp_path / "up")  # the same directory reached through a link
    with pytest.raises(ValueError, match="is or holds the input"):
        check_output_dir(tmp_path / "up" / "in", marker=".m", writer="w", overwrite=True, inputs=[source])
    with pytest.raises(ValueError, match="sits inside the input"):
        check_output_file(source / "job.sbatch", [source])
    check_output_dir(tmp_path / "beside", marker=".m", writer="w", overwrite=False, inputs=[source, None])


def test_convert_import_refuses_a_directory_inside_its_source(hf_dir, capsys):
    before = snapshot(hf_dir)
    assert main(["convert", "import", str(hf_dir), str(hf_dir / "native")]) == 2
    assert "sits inside the input" in capsys.readouterr().err and snapshot(hf_dir) == before


@pytest.fixture()
def adapter(hf_dir, tmp_path):
    import torch

    from openrecipes.checkpoint.hf import from_hf
    from openrecipes.checkpoint.lora import save_peft_adapter
    from openrecipes.models.common.lora import LoraSpec, apply_lora

    spec = LoraSpec(rank=2, alpha=4.0, targets=("q_proj",))
    model = from_hf(hf_dir, dtype=torch.float32)
    apply_lora(model, spec)
    save_peft_adapter(model, spec, tmp_path / "adapter", base_model=str(hf_dir))
    return tmp_path / "adapter"


def merge_lora(base, adapter, out, *extra):
    return main(["convert", "merge-lora", str(base), str(adapter), "--out", str(out), *extra])


def test_merge_lora_never_replaces_or_writes_into_its_base(hf_dir, adapter, capsys):
    before = snapshot(hf_dir)  # save_hf marked it: an --overwrite on it once replaced the base model
    assert merge_lora(hf_dir, adapter, hf_dir, "--overwrite") == 2
    assert "is or holds the input" in capsys.readouterr().err
    assert merge_lora(hf_dir, adapter, hf_dir / "merged") == 2
    assert "sits inside the input" in capsys.readouterr().err
    assert snapshot(hf_dir) == before


def test_merge_lora_never_replaces_a_directory_holding_its_adapter(hf_dir, adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    assert merge_lora(hf_dir, adapter, out) == 0
    shutil.move(adapter, out / "adapter")  # the user keeps the adapter beside its merge
    kept = snapshot(out / "adapter")
    assert merge_lora(hf_dir, out / "adapter", out, "--overwrite") == 2
    assert "is or holds the input" in capsys.readouterr().err and snapshot(out / "adapter") == kept


def test_data_build_never_replaces_the_image_processor_it_reads(tmp_path, capsys):
    from openrecipes.data import bundled
    from openrecipes.data.packed import DATA_MARKER

    rows = tmp_path / "rows"  # an earlier build's output (its marker), where the user keeps the processor
    rows.mkdir()
    (rows / DATA_MARKER).write_text("")
    processor = rows / "preprocessor_config.json"
    shutil.copy(bundled.IMAGE_PROCESSOR, processor)
    code = main(["data", "build", str(BUNDLED_CONVERSATIONS), "--tokenizer", str(bundled.VL_TOKENIZER),
                 "--loss-mask", "qwen3", "--row-tokens", "64", "--rows", "2", "--no-progress",
                 "--image-processor", str(processor), "--out", str(rows), "--overwrite"])
    assert code == 2 and "is or holds the input" in capsys.readouterr().err
    assert processor.read_bytes() == bundled.IMAGE_PROCESSOR.read_bytes()


def launch_slurm(recipe, out):
    return main(["launch", "slurm", str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--out", str(out)])


def test_launch_slurm_never_replaces_its_recipe_or_a_file_it_did_not_write(tmp_path, capsys):
    recipe = tmp_path / "tiny.yaml"
    shutil.copy("examples/tiny-qwen3-sft.yaml", recipe)
    before = recipe.read_bytes()
    assert launch_slurm(recipe, recipe) == 2
    assert "is or holds the input" in capsys.readouterr().err and recipe.read_bytes() == before
    notes = tmp_path / "notes.sbatch"
    notes.write_text("#!/bin/bash\necho mine\n")
    assert launch_slurm(recipe, notes) == 2
    assert "was not written by openrecipes launch slurm" in capsys.readouterr().err
    assert notes.read_text() == "#!/bin/bash\necho mine\n"
    script = tmp_path / "job.sbatch"
    assert launch_slurm(recipe, script) == 0 and launch_slurm(recipe, script) == 0  # its own script: replaced
    assert "#SBATCH --nodes=1" in script.read_text()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_get_the_modes_a_plain_open_and_mkdir_give(tmp_path, umask):
    import stat

    from openrecipes.utils import atomic_output_dir, atomic_write_text

    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "file.txt", "text\n")
        with atomic_output_dir(tmp_path / "out") as staging:
            atomic_write_text(staging / "inner.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "file.txt").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "out" / "inner.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_an_output_under_a_file_is_named_by_its_option(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"--out: .*notes\.txt is not a directory, so .* cannot be made"):
        check_output_dir(tmp_path / "notes.txt" / "rows", marker=".m", writer="w", overwrite=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"
