"""Every file of a native checkpoint is checked before its weights are used, openrecipes.json included; an import
takes finite float weights only."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from openrecipes.checkpoint.checksums import CHECKSUMS_FILE
from openrecipes.checkpoint.native import MANIFEST, NATIVE_MARKER, import_hf, load_native_state
from openrecipes.cli import main
from tests.checkpoint.test_safe_load import native_dir  # noqa: F401  (fixture)

FILES = (".metadata", "__0_0.distcp", "config.json", MANIFEST, CHECKSUMS_FILE)


@pytest.fixture()
def copy(native_dir, tmp_path):  # noqa: F811
    target = tmp_path / "ckpt"
    shutil.copytree(native_dir, target)
    return target


def test_checksums_list_every_file_but_themselves_and_the_overwrite_marker(copy):
    names = {p.name for p in copy.iterdir()}
    assert names == {*FILES, NATIVE_MARKER}  # a new file must join FILES (and so the flip test below)
    listed = set(json.loads((copy / CHECKSUMS_FILE).read_text())["files"])
    assert listed == names - {CHECKSUMS_FILE, NATIVE_MARKER}


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_in_any_file_stops_the_export_in_one_line(copy, tmp_path, capsys, name):
    path = copy / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert main(["convert", "export", str(copy), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and (name in err or CHECKSUMS_FILE in err), err
    assert not (tmp_path / "hf").exists()


def _retype(copy, key, value):
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["tensors"]["model.norm.weight"][key] = value
    (copy / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def test_a_rewritten_manifest_is_named_as_damaged(copy, tmp_path):
    _retype(copy, "source_dtype", "float16")  # as long as float32, valid, and export would round the tensor to it
    with pytest.raises(ValueError, match=rf"{MANIFEST}: damaged: its sha256 differs"):
        load_native_state(copy)


def test_a_manifest_claiming_integer_weights_is_refused_without_checksums(copy, tmp_path, capsys):
    _retype(copy, "dtype", "int32")
    (copy / CHECKSUMS_FILE).unlink()  # the manifest is read before the checksums are: it is refused first
    assert main(["convert", "export", str(copy), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "'model.norm.weight': dtype 'int32' is not a floating-point weight dtype" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_import_refuses_non_finite_weights_naming_the_tensor(native_dir, tmp_path, value):  # noqa: F811
    hf = tmp_path / "hf"
    shutil.copytree(native_dir.parent / "hf", hf)
    (shard,) = hf.glob("*.safetensors")
    tensors = load_file(shard)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[name][2, 5] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    # named as the file stores it: the reader checks every tensor it reads (HFCheckpoint)
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{re.escape(name)}' holds NaN or inf"):
        import_hf(hf, tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_finite_weights_import(native_dir):  # noqa: F811
    state, _ = load_native_state(native_dir)
    assert state and all(t.is_floating_point() and bool(torch.isfinite(t).all()) for t in state.values())


def test_a_manifest_shape_larger_than_the_files_is_refused_before_allocating(copy, tmp_path, capsys):
    from openrecipes.checkpoint.checksums import write_checksums

    # read before the checksums: torch.empty of this shape failed with a RuntimeError traceback (or allocated it)
    _retype(copy, "shape", [2**40, 2**40])
    (copy / CHECKSUMS_FILE).unlink()
    write_checksums(copy, no_dist=True)  # checksums are integrity, not authorship: whoever edits can rewrite them
    assert main(["convert", "export", str(copy), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{MANIFEST}: not a native checkpoint manifest" in err and "needs more bytes than" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("value", ["int64", "Tensor", "bogus", 5])
def test_a_manifest_source_dtype_that_is_no_float_dtype_is_refused(copy, tmp_path, capsys, value):
    from openrecipes.checkpoint.checksums import write_checksums

    _retype(copy, "source_dtype", value)
    (copy / CHECKSUMS_FILE).unlink()
    write_checksums(copy, no_dist=True)  # checksums are integrity, not authorship: whoever edits can rewrite them
    assert main(["convert", "export", str(copy), str(tmp_path / "hf")]) == 2  # was a traceback, or int64 weights
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'model.norm.weight'" in err and "source_dtype" in err, err
    assert not (tmp_path / "hf").exists()


def _rewrite_manifest(copy, edit):
    from openrecipes.checkpoint.checksums import write_checksums

    manifest = json.loads((copy / MANIFEST).read_text())
    edit(manifest["tensors"])
    (copy / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (copy / CHECKSUMS_FILE).unlink()
    write_checksums(copy, no_dist=True)  # checksums are integrity, not authorship: whoever edits can rewrite them


def test_a_manifest_without_a_tensor_of_the_model_exports_nothing(copy, tmp_path, capsys):
    _rewrite_manifest(copy, lambda tensors: tensors.pop("model.norm.weight"))  # the shards still hold it: loads
    assert main(["convert", "export", str(copy), str(tmp_path / "hf")]) == 2  # was an export without the tensor
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing ['model.norm.weight']" in err and "config.json" in err, err
    assert not (tmp_path / "hf").exists()
