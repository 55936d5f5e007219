"""Rows are checked against their manifest before they train: a changed rows.parquet is named in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from openrecipes.data.batching import load_rows
from openrecipes.utils import sha256_file


@pytest.fixture()
def rows(tiny_rows: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "rows"
    shutil.copytree(tiny_rows, copy)
    return copy


def _refused(rows: Path) -> str:
    with pytest.raises(ValueError) as error:
        load_rows(rows)
    message = str(error.value)
    assert len(message.splitlines()) == 1
    return message


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])  # inside compressed pages (some still decode) and the footer
def test_a_flipped_byte_in_the_parquet_is_named_with_both_hashes(rows: Path, where: float) -> None:
    parquet = rows / "rows.parquet"
    expected = json.loads((rows / "manifest.json").read_text())["parquet_sha256"]
    data = bytearray(parquet.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    parquet.write_bytes(bytes(data))
    message = _refused(rows)
    assert str(parquet) in message and expected in message and sha256_file(parquet) in message


def test_a_valid_parquet_with_other_ids_is_refused(rows: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(rows / "rows.parquet")
    ids = table.column("input_ids").to_pylist()
    ids[0] = [(token + 1) % 100 for token in ids[0]]
    table = table.set_column(0, "input_ids", pa.array(ids, type=pa.list_(pa.int32())))
    pq.write_table(table, rows / "rows.parquet", compression="zstd")
    load_rows(rows / "rows.parquet")  # a well-formed file: only the manifest tells it apart
    assert "is not the parquet_sha256" in _refused(rows)


def test_a_manifest_without_the_parquet_hash_is_refused(rows: Path) -> None:
    manifest = json.loads((rows / "manifest.json").read_text())
    del manifest["parquet_sha256"]
    (rows / "manifest.json").write_text(json.dumps(manifest))
    assert "missing field 'parquet_sha256'" in _refused(rows)


def test_unchanged_rows_load(rows: Path) -> None:
    assert len(load_rows(rows)) == json.loads((rows / "manifest.json").read_text())["rows"]


def test_train_refuses_changed_rows_before_step_0(rows: Path, tmp_path: Path) -> None:
    from openrecipes.config.recipe import recipe_from_dict
    from openrecipes.train.loop import train

    data = bytearray((rows / "rows.parquet").read_bytes())
    data[len(data) // 2] ^= 0x01
    (rows / "rows.parquet").write_bytes(bytes(data))
    recipe = recipe_from_dict({"model": "qwen3-moe-tiny", "data": {"rows": str(rows)},
                               "layout": {"max_tokens_per_gpu": 256}, "precision": "fp32", "steps": 1,
                               "global_batch": 1, "run_dir": str(tmp_path / "run"), "logging": {"progress": False}})
    with pytest.raises(ValueError, match="rows.parquet: sha256 .* is not the parquet_sha256"):
        train(recipe, command="test")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
