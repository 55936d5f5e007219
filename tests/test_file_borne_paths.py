"""A path read from a file (a DCP ``.metadata`` storage entry, ``checksums.json``, a rows manifest, an image sidecar,
the tuner's trial records) stays inside its own folder: ``..``, an absolute name or a link leading out is refused
with one line naming the file and the key, before anything outside is opened."""

import dataclasses
import hashlib
import json
import os
import pickle
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from openrecipes.utils import path_inside

_OPENED: list[str] | None = None  # paths opened while a test records them (see `opened`)


def _record_opens(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_record_opens)  # audit hooks cannot be removed; this one does nothing unless a test records


@pytest.fixture()
def opened():
    """Every path the process opens during the test (Python's ``open`` audit event)."""
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


# ---- the helper itself


@pytest.mark.parametrize("name, reason", [
    ("../secret", "'..'"), ("a/../../secret", "'..'"), ("/etc/passwd", "absolute"), ("", "empty"),
    ("a\\..\\b", "backslash"), ("a\0b", "NUL"), (".", "the folder itself"), (None, "not a string"),
    (["a"], "not a string"),
])
def test_names_that_leave_their_folder_are_refused_naming_file_and_key(tmp_path, name, reason):
    with pytest.raises(ValueError, match=rf"^m\.json: files: .* is not a path inside {tmp_path} \(.*{reason}"):
        path_inside(tmp_path, name, source="m.json", key="files")


def test_a_plain_name_has_no_sub_folder(tmp_path):
    assert path_inside(tmp_path, "sub/x", source="m.json", key="k") == tmp_path / "sub" / "x"
    with pytest.raises(ValueError, match="'sub/x' is not a file name inside .* sub-folder"):
        path_inside(tmp_path, "sub/x", source="m.json", key="k", plain_name=True)


def test_links_are_followed_and_must_stay_inside(tmp_path):
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    outside.mkdir()
    (folder / "inner").symlink_to(folder / "sub")
    (folder / "leaves").symlink_to(outside / "x")
    (folder / "door").symlink_to(outside)
    assert path_inside(folder, "inner/x", source="m", key="k") == folder / "inner" / "x"
    for name in ("leaves", "door/x"):  # the name itself, or a folder on its way
        with pytest.raises(ValueError, match=rf"m: k: '{name}' .* resolves to {outside}"):
            path_inside(folder, name, source="m", key="k")
    # a Hugging Face snapshot's links to its blobs: allowed where asked for, the name rules still hold
    assert path_inside(folder, "leaves", source="m", key="k", links_may_leave=True) == folder / "leaves"
    with pytest.raises(ValueError, match="'..'"):
        path_inside(folder, "../outside/x", source="m", key="k", links_may_leave=True)


def test_a_link_to_the_folder_seen_through_another_link_is_inside(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert path_inside(tmp_path / "alias", "x", source="m", key="k") == tmp_path / "alias" / "x"


# ---- DCP storage entries (.metadata relative_path)


def _save(directory: Path, value: float) -> None:
    from openrecipes.checkpoint.checksums import write_checksums

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.full((4,), value)}, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    write_checksums(directory, no_dist=True)  # as every save writes them


def _point_storage_at(ckpt: Path, relative_path: str) -> None:
    """Rewrite the checkpoint's .metadata so every item is read from ``relative_path``, with DCP's own classes only
    (what the restricted unpickler allows)."""
    with open(ckpt / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=relative_path)
                             for index, info in metadata.storage_data.items()}
    with open(ckpt / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


@pytest.fixture()
def planted(tmp_path):
    """A checkpoint of zeros and, outside it, secret.bin: the shard of a save of 7s (a torch.save file)."""
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    _save(ckpt, 0.0)
    _save(other, 7.0)
    secret = tmp_path / "secret.bin"
    next(other.glob("*.distcp")).rename(secret)
    return ckpt, secret


@pytest.mark.parametrize("how", ["climbs", "absolute", "link"])
def test_a_storage_path_leaving_the_checkpoint_is_refused(planted, how, opened):
    from openrecipes.checkpoint.checksums import write_checksums
    from openrecipes.checkpoint.safe_load import load_dcp

    ckpt, secret = planted
    if how == "link":
        (ckpt / "shard.distcp").symlink_to(secret)
    name = {"climbs": "../secret.bin", "absolute": str(secret), "link": "shard.distcp"}[how]
    _point_storage_at(ckpt, name)
    write_checksums(ckpt, no_dist=True)  # forged to match; a link among the files is refused by that list already
    state = {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match=rf"{ckpt}/(\.metadata: storage_data\['w'\]\.relative_path|checksums\.json: "
                                         rf"files): '{name}' is not a file name inside"):
        load_dcp(state, ckpt, no_dist=True)
    assert torch.equal(state["w"], torch.zeros(4))
    assert str(secret) not in opened


def test_forged_checksums_do_not_let_a_storage_path_out(planted, opened):
    """checksums.json written to match the planted .metadata: the storage path is refused all the same."""
    from openrecipes.checkpoint.checksums import write_checksums
    from openrecipes.checkpoint.safe_load import load_dcp, read_dcp_metadata

    ckpt, secret = planted
    _point_storage_at(ckpt, "../secret.bin")
    write_checksums(ckpt, no_dist=True)
    with pytest.raises(ValueError, match=r"relative_path: '\.\./secret\.bin' .* '\.\.'"):
        read_dcp_metadata(ckpt / ".metadata")
    with pytest.raises(ValueError, match="relative_path"):
        load_dcp({"w": torch.zeros(4)}, ckpt, no_dist=True)
    assert str(secret) not in opened


def test_the_storage_paths_dcp_writes_are_accepted(planted):
    from openrecipes.checkpoint.safe_load import load_dcp

    ckpt, _ = planted
    _save(ckpt.parent / "fresh", 3.0)
    state = {"w": torch.zeros(4)}
    load_dcp(state, ckpt.parent / "fresh", no_dist=True)
    assert torch.equal(state["w"], torch.full((4,), 3.0))


# ---- checksums.json file names


@pytest.mark.parametrize("how", ["climbs", "absolute", "link"])
def test_a_checksum_entry_leaving_the_checkpoint_is_refused(planted, how, opened):
    from openrecipes.checkpoint.checksums import CHECKSUMS_FILE, write_checksums, verify_checksums

    ckpt, secret = planted
    if how == "link":
        (ckpt / "extra.distcp").symlink_to(secret)
    write_checksums(ckpt, no_dist=True)  # hashes the link's target too: the list is forged to match
    document = json.loads((ckpt / CHECKSUMS_FILE).read_text())
    entry = {"bytes": secret.stat().st_size, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    name = {"climbs": "../secret.bin", "absolute": str(secret), "link": "extra.distcp"}[how]
    document["files"][name] = entry
    (ckpt / CHECKSUMS_FILE).write_text(json.dumps(document))
    opened.clear()
    with pytest.raises(ValueError, match=rf"{ckpt}/checksums\.json: files: '{name}' is not a file name inside"):
        verify_checksums(ckpt, no_dist=True)
    assert str(secret) not in opened


# ---- image rows: the manifest's sidecar and the sidecar's image names


def _image_rows(directory: Path, sidecar_name: str, digest: str) -> tuple[dict, np.ndarray]:
    """A rows directory's manifest (images section) and rows for one image of 4 tokens named ``digest``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from openrecipes.data.image_rows import SIDECAR_COLUMNS, SIDECAR_FILE

    directory.mkdir(parents=True, exist_ok=True)
    columns = {name: pa.array([value], type=pa.int32()) for name, value in zip(SIDECAR_COLUMNS, (0, 0, 4, 0, 4, 4))}
    columns["sha256"] = pa.array([digest], type=pa.string())
    pq.write_table(pa.table(columns), str(directory / SIDECAR_FILE))
    sidecar_sha = hashlib.sha256((directory / SIDECAR_FILE).read_bytes()).hexdigest()
    images = {"sidecar": sidecar_name, "sidecar_sha256": sidecar_sha, "image_token_id": 9,
              "processor": {"merge_size": 2}}
    return {"images": images}, np.full((1, 4), 9, dtype=np.int64)


def test_an_image_name_leaving_the_images_folder_is_refused(tmp_path, opened):
    from openrecipes.data.image_batch import load_row_images

    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not yours")
    rows = tmp_path / "a" / "rows"
    manifest, ids = _image_rows(rows, "images.parquet", "../../../secret.png")
    opened.clear()
    with pytest.raises(ValueError, match=rf"{rows}/images\.parquet: sha256: '\.\./\.\./\.\./secret\.png' is not a "
                                         "file name inside"):
        load_row_images(rows, manifest, ids)
    assert str(secret) not in opened


@pytest.mark.parametrize("how", ["climbs", "absolute", "link"])
def test_a_sidecar_outside_the_rows_is_refused(tmp_path, how, opened):
    from openrecipes.data.image_batch import load_row_images

    rows = tmp_path / "rows"
    manifest, ids = _image_rows(tmp_path / "elsewhere", "images.parquet", "0" * 64)
    rows.mkdir()
    if how == "link":
        (rows / "linked.parquet").symlink_to(tmp_path / "elsewhere" / "images.parquet")
    name = {"climbs": "../elsewhere/images.parquet", "absolute": str(tmp_path / "elsewhere" / "images.parquet"),
            "link": "linked.parquet"}[how]
    manifest["images"]["sidecar"] = name
    opened.clear()
    with pytest.raises(ValueError, match=rf"{rows}/manifest\.json: images\.sidecar: '{name}' is not a file name"):
        load_row_images(rows, manifest, ids)
    assert str(tmp_path / "elsewhere" / "images.parquet") not in opened


# ---- the tuner's trial records


def _failed_record(key, run_dir, measured_under="0" * 64):
    record = {"index": 0, "key": key, "phase": "ranked", "changes": {}, "label": key, "layout": "TP1",
              "prediction": None, "status": "failed", "failure": {"class": "crash", "detail": "x"}, "measured": None,
              "wall_s": 1.0, "finished": "2026-12-02T00:00:00Z", "measured_under": measured_under}
    return record if run_dir is None else {**record, "run_dir": run_dir}


@pytest.mark.parametrize("how", ["climbs", "absolute", "link", "missing"])
def test_a_trial_record_whose_run_leaves_the_output_is_refused(tmp_path, how):
    from openrecipes.tune.journal import TRIALS_FILE, Journal

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    (out / "trials").mkdir(parents=True)
    elsewhere.mkdir()
    (out / "trials" / "000-start").symlink_to(elsewhere, target_is_directory=True)
    good = _failed_record("a", "trials/001-a/run")
    run_dir = {"climbs": "../elsewhere/run", "absolute": str(elsewhere / "run"), "link": "trials/000-start/run",
               "missing": None}[how]
    bad = _failed_record("start", run_dir)
    (out / TRIALS_FILE).write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    expected = (rf"{out}/trials\.jsonl:2: .*run_dir: Field required" if how == "missing"
                else rf"{out}/trials\.jsonl:2: run_dir: .* is not a path inside {out}")
    with pytest.raises(ValueError, match=expected):
        Journal(out, measured_under="0" * 64)
    (out / TRIALS_FILE).write_text(json.dumps(good) + "\n")
    assert Journal(out, measured_under="0" * 64).find("a")["run_dir"] == "trials/001-a/run"


# ---- a rows manifest's parquet_file, a Hugging Face dataset's state.json


@pytest.mark.parametrize("how", ["climbs", "absolute", "link"])
def test_a_parquet_file_outside_the_rows_is_refused(tmp_path, how, opened):
    from openrecipes.data.manifest import read_manifest

    rows, secret = tmp_path / "rows", tmp_path / "secret.parquet"
    rows.mkdir()
    secret.write_bytes(b"PAR1 not yours")
    if how == "link":
        (rows / "rows.parquet").symlink_to(secret)
    name = {"climbs": "../secret.parquet", "absolute": str(secret), "link": "rows.parquet"}[how]
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    manifest = {"row_tokens": 64, "parquet_file": name, "parquet_sha256": digest}
    (rows / "manifest.json").write_text(json.dumps(manifest))
    opened.clear()
    with pytest.raises(ValueError, match=rf"{rows}/manifest\.json: parquet_file: '{name}' is not a file name inside"):
        read_manifest(rows, check_parquet=True)
    assert str(secret) not in opened



def test_a_resume_does_not_hash_a_parquet_file_outside_the_rows(tmp_path, opened):
    """Rows whose manifest has no parquet_sha256: a resume hashes the file parquet_file names, inside the rows only."""
    from openrecipes.train.resume import rows_sha256

    rows, secret = tmp_path / "rows", tmp_path / "secret.parquet"
    rows.mkdir()
    secret.write_bytes(b"not yours")
    (rows / "manifest.json").write_text(json.dumps({"row_tokens": 64, "parquet_file": "../secret.parquet"}))
    opened.clear()
    with pytest.raises(ValueError, match=r"manifest\.json: parquet_file: '\.\./secret\.parquet' is not a file name"):
        rows_sha256(rows)
    assert str(secret) not in opened

@pytest.mark.parametrize("how", ["climbs", "absolute", "link"])
def test_a_dataset_file_outside_the_dataset_is_refused(tmp_path, how, opened):
    from openrecipes.data.sources import open_source

    dataset, secret = tmp_path / "dataset", tmp_path / "secret.jsonl"
    dataset.mkdir()
    secret.write_text(json.dumps({"messages": [{"role": "user", "content": "not yours"}]}) + "\n")
    if how == "link":
        (dataset / "data.jsonl").symlink_to(secret)
    name = {"climbs": "../secret.jsonl", "absolute": str(secret), "link": "data.jsonl"}[how]
    (dataset / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
    opened.clear()
    with pytest.raises(ValueError, match=rf"{dataset}/state\.json: _data_files\[\]\.filename: '{name}' is not a path"):
        open_source(dataset)
    assert str(secret) not in opened


# ---- checkpoints/latest


def test_latest_naming_a_save_linked_from_elsewhere_is_refused(tmp_path):
    from openrecipes.checkpoint.training_save import latest_checkpoint

    outside = tmp_path / "outside" / "step-000001"
    outside.mkdir(parents=True)
    (outside / ".metadata").write_bytes(b"")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "step-000001").symlink_to(outside, target_is_directory=True)
    (root / "latest").write_text("step-000001\n")
    with pytest.raises(ValueError, match=rf"{root}/latest names step-000001, which is not a complete checkpoint"):
        latest_checkpoint(tmp_path / "run")
