"""Every checkpoint file carries a sha256 from the save; a damaged one is named at load, in one line."""

import json
import shutil

import pytest

from openrecipes.checkpoint.checksums import CHECKSUMS_FILE
from openrecipes.checkpoint.native import load_native_state
from openrecipes.cli import main
from tests.checkpoint.test_safe_load import native_dir  # noqa: F401  (fixture)


@pytest.fixture()
def copy(native_dir, tmp_path):  # noqa: F811
    target = tmp_path / "ckpt"
    shutil.copytree(native_dir, target)
    return target


def shard(ckpt):
    return next(ckpt.glob("*.distcp"))


def test_the_save_lists_every_file(copy):
    listed = json.loads((copy / CHECKSUMS_FILE).read_text())["files"]
    assert {shard(copy).name, ".metadata", "config.json"} <= set(listed)


def test_a_flipped_byte_in_a_shard_is_named(copy, tmp_path, capsys):
    data = bytearray(shard(copy).read_bytes())
    data[len(data) // 2] ^= 0x01  # still a valid pickle, just other numbers
    shard(copy).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"__0_0\.distcp: damaged: its sha256 differs"):
        load_native_state(copy)
    assert main(["convert", "export", str(copy), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "__0_0.distcp: damaged" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["shard", ".metadata", "config.json"])
def test_truncated_files_are_named(copy, name):
    path = shard(copy) if name == "shard" else copy / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{path.name.replace('.', r'[.]')}: damaged: .* bytes"):
        load_native_state(copy)


def test_a_missing_shard_and_a_garbled_checksum_file(copy):
    (copy / CHECKSUMS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{CHECKSUMS_FILE}: damaged checksum file"):
        load_native_state(copy)
    (copy / CHECKSUMS_FILE).unlink()  # a checkpoint without one is refused: test_load_refusals.py
    with pytest.raises(FileNotFoundError, match=f"{CHECKSUMS_FILE}: missing from {copy}"):
        load_native_state(copy)


def test_a_missing_shard_is_named(copy):
    shard(copy).unlink()
    with pytest.raises(FileNotFoundError, match=rf"__0_0\.distcp: missing \(listed in {CHECKSUMS_FILE}\)"):
        load_native_state(copy)


def test_a_garbled_manifest_is_named(copy):
    (copy / "openrecipes.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match=r"openrecipes\.json: not valid JSON"):
        load_native_state(copy)
    (copy / "openrecipes.json").write_text(json.dumps({"tensors": {"x": {"shape": [2], "dtype": "load"}}}))
    with pytest.raises(ValueError, match="unknown dtype 'load'"):
        load_native_state(copy)


def test_a_deeply_nested_checksum_file_is_named(copy):
    (copy / CHECKSUMS_FILE).write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError traceback
    with pytest.raises(ValueError, match=rf"{CHECKSUMS_FILE}: damaged checksum file"):
        load_native_state(copy)
