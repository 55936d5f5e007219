"""Checkpoint files are data: a planted pickle in a DCP checkpoint is refused and never runs."""

import os
import pickle
import shlex
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from openrecipes.checkpoint.checksums import write_checksums
from openrecipes.checkpoint.hf import save_hf
from openrecipes.checkpoint.native import import_hf, load_native_state
from openrecipes.checkpoint.safe_load import load_dcp, read_dcp_metadata
from openrecipes.cli import main
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config


class RunsCode:
    """Pickles to a call of os.system: unpickling it would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant_metadata(ckpt_dir, marker):
    """A hostile .metadata; the checksum file is rewritten to match (whoever plants one can hash it), so the
    unpickler is what has to refuse it."""
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    write_checksums(ckpt_dir, no_dist=True)


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    save_hf(build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=3), root / "hf")
    import_hf(root / "hf", root / "native")
    return root / "native"


def test_a_real_checkpoint_loads(native_dir):
    state, config = load_native_state(native_dir)
    assert config["model_type"] == "qwen3_moe" and all(torch.isfinite(t).all() for t in state.values())


def test_planted_metadata_is_refused_by_the_loader(native_dir, tmp_path):
    planted, marker = tmp_path / "planted", tmp_path / "ran"
    shutil.copytree(native_dir, planted)
    plant_metadata(planted, marker)
    with pytest.raises(ValueError, match=r"\.metadata: refused to load: its pickle names posix\.system"):
        load_native_state(planted)
    assert not marker.exists()


def test_planted_metadata_is_refused_by_convert_export(native_dir, tmp_path, capsys):
    planted, marker = tmp_path / "planted", tmp_path / "ran"
    shutil.copytree(native_dir, planted)
    plant_metadata(planted, marker)
    assert main(["convert", "export", str(planted), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "refused to load" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_planted_byte_item_is_refused(tmp_path):
    marker = tmp_path / "ran"
    dcp.save({"lr": RunsCode(marker)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    write_checksums(tmp_path / "ckpt", no_dist=True)
    with pytest.raises(ValueError, match="'lr': refused or unreadable"):
        load_dcp({"lr": 0.0}, tmp_path / "ckpt", no_dist=True)
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", pickle.dumps({"not": "metadata"})])
def test_garbled_metadata_is_one_clear_error(native_dir, tmp_path, content):
    garbled = tmp_path / "garbled"
    shutil.copytree(native_dir, garbled)
    (garbled / ".metadata").write_bytes(content)
    with pytest.raises(ValueError, match=r"\.metadata: not (readable )?checkpoint metadata"):
        read_dcp_metadata(garbled / ".metadata")


@pytest.fixture()
def sharded_hf(tmp_path):
    path = tmp_path / "hf"
    save_hf(build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=3), path, max_shard_bytes=200_000)
    return path


@pytest.mark.parametrize("shard", ["../outside/x.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_an_index_pointing_outside_the_directory_is_refused(sharded_hf, tmp_path, shard):
    import json

    from openrecipes.checkpoint.safetensors_io import INDEX_NAME

    (tmp_path / "outside").mkdir()
    first = sorted(sharded_hf.glob("*.safetensors"))[0]
    shutil.copy(first, tmp_path / "outside" / "x.safetensors")
    index = json.loads((sharded_hf / INDEX_NAME).read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = shard
    (sharded_hf / INDEX_NAME).write_text(json.dumps(index))
    assert main(["convert", "import", str(sharded_hf), str(tmp_path / "native")]) == 2
    with pytest.raises(ValueError, match="is not a file name inside"):
        import_hf(sharded_hf, tmp_path / "native")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn])
def test_weights_in_unexpected_dtypes_are_refused_by_name(tmp_path, dtype):
    from safetensors.torch import load_file, save_file

    source = tmp_path / "hf"
    save_hf(build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=3), source)
    tensors = load_file(source / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, str(source / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' in .*model\.safetensors: dtype \w+ is not a weight"):
        import_hf(source, tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_an_unknown_pickle_protocol_names_the_file(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x09garbage")
    with pytest.raises(ValueError, match=r"\.metadata: not readable checkpoint metadata"):
        read_dcp_metadata(tmp_path / ".metadata")


def test_shards_linked_from_elsewhere_still_load(sharded_hf, tmp_path):
    """The Hugging Face cache links snapshot files to blobs outside the snapshot directory."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for path in sharded_hf.iterdir():
        shutil.copy(path, blobs / path.name)
        (snapshot / path.name).symlink_to(blobs / path.name)
    assert import_hf(snapshot, tmp_path / "native")["tensors"]
