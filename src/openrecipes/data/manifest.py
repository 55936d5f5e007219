"""rows.parquet writing and hashing, and the manifest that describes a build.

rows.parquet columns (one parquet row per training row):
  input_ids  list<int32>  exactly row_tokens token ids
  loss_mask  list<int8>   1 where the token is a target of the loss, else 0
  doc_lens   list<int32>  lengths of the document pieces in the row, in order; they sum to row_tokens
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

ROWS_FILE = "rows.parquet"
MANIFEST_FILE = "manifest.json"
MAX_TOKEN_ID = "max_token_id"  # the manifest's key for the largest token id in the rows
FORMAT = "openrecipes.sft-rows.v1"
ROWS_SHA256_DEFINITION = (
    "SHA-256 over the rows in file order; for each row, its row_tokens input_ids as little-endian int32 "
    "bytes followed by its row_tokens loss_mask values as uint8 bytes; nothing else (no lengths, "
    "separators or document boundaries)")
# Row groups hold a fixed number of rows, so the file layout depends only on the rows.
ROW_GROUP_TOKENS = 1 << 22


def update_rows_hash(digest: Any, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
    """Feed (R, T) rows into ``digest`` as ROWS_SHA256_DEFINITION says."""
    ids = np.ascontiguousarray(input_ids, dtype="<i4")
    mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
    for r in range(ids.shape[0]):
        digest.update(ids[r].tobytes())
        digest.update(mask[r].tobytes())


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                      ("doc_lens", pa.list_(pa.int32()))])


class RowsWriter:
    """Streams rows into a parquet file in fixed-size row groups and hashes them."""

    def __init__(self, path: Path, row_tokens: int) -> None:
        import pyarrow.parquet as pq

        self.path = path
        self.row_tokens = row_tokens
        self.group_rows = max(1, ROW_GROUP_TOKENS // row_tokens)
        self.digest = hashlib.sha256()
        self.rows = 0
        self.supervised = 0
        self.max_token_id = -1  # the largest input id written: the model's vocabulary must hold it (MAX_TOKEN_ID)
        self._pending: list[tuple[np.ndarray, np.ndarray, list[np.ndarray]]] = []
        self._pending_rows = 0
        self._writer = pq.ParquetWriter(str(path), _schema(), compression="zstd", use_dictionary=False,
                                        write_statistics=False)

    def add(self, input_ids: np.ndarray, loss_mask: np.ndarray, doc_lens: list[np.ndarray]) -> None:
        if input_ids.shape[0] == 0:
            return
        update_rows_hash(self.digest, input_ids, loss_mask)
        self.max_token_id = max(self.max_token_id, int(input_ids.max()))
        self.rows += input_ids.shape[0]
        self.supervised += int(loss_mask.sum(dtype=np.int64))
        self._pending.append((input_ids, loss_mask, doc_lens))
        self._pending_rows += input_ids.shape[0]
        while self._pending_rows >= self.group_rows:
            self._flush(self.group_rows)

    def _flush(self, n: int) -> None:
        import pyarrow as pa

        ids = np.concatenate([p[0] for p in self._pending])
        mask = np.concatenate([p[1] for p in self._pending])
        lens = [x for p in self._pending for x in p[2]]
        T = self.row_tokens
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * T)
        doc_counts = np.array([x.size for x in lens[:n]], dtype=np.int32)
        doc_offsets = pa.array(np.concatenate([[0], np.cumsum(doc_counts)]).astype(np.int32))
        flat_lens = np.concatenate(lens[:n]).astype(np.int32) if n else np.zeros(0, np.int32)
        table = pa.Table.from_arrays(
            [pa.ListArray.from_arrays(offsets, pa.array(ids[:n].reshape(-1))),
             pa.ListArray.from_arrays(offsets, pa.array(mask[:n].reshape(-1))),
             pa.ListArray.from_arrays(doc_offsets, pa.array(flat_lens))],
            schema=_schema())
        self._writer.write_table(table, row_group_size=n)
        rest = ids.shape[0] - n
        self._pending = [(ids[n:], mask[n:], lens[n:])] if rest else []
        self._pending_rows = rest

    def close(self) -> None:
        if self._pending_rows:
            self._flush(self._pending_rows)
        self._writer.close()

    @property
    def rows_sha256(self) -> str:
        return self.digest.hexdigest()


def rows_sha256_of(path: str | Path) -> str:
    """Recompute rows_sha256 from a rows.parquet file."""
    import pyarrow.parquet as pq

    digest = hashlib.sha256()
    parquet = pq.ParquetFile(str(path))
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group, columns=["input_ids", "loss_mask"])
        n = table.num_rows
        if n == 0:
            continue
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy()
        update_rows_hash(digest, ids.reshape(n, -1), mask.reshape(n, -1))
    return digest.hexdigest()


def rows_max_token_id(directory: str | Path) -> int:
    """The largest token id in a built rows directory: its manifest's MAX_TOKEN_ID, or for rows built before builds
    recorded it, the largest id of the parquet file's input_ids (read one row group at a time)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    manifest = read_manifest(directory)
    recorded = manifest.get(MAX_TOKEN_ID)
    if recorded is not None:
        if not isinstance(recorded, int) or isinstance(recorded, bool):
            raise ValueError(f"{Path(directory) / MANIFEST_FILE}: {MAX_TOKEN_ID} must be an integer, got {recorded!r}")
        return recorded
    path = Path(directory) / ROWS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    parquet = pq.ParquetFile(str(path))
    largest = -1
    for group in range(parquet.num_row_groups):
        ids = parquet.read_row_group(group, columns=["input_ids"]).column("input_ids").combine_chunks().flatten()
        group_max = pc.max(ids).as_py()
        largest = largest if group_max is None else max(largest, group_max)
    return largest


# the manifest's counts and their least values
_COUNTS = {"row_tokens": 1, "rows": 0, "parquet_bytes": 0}


def read_manifest(directory: str | Path, *, require: tuple[str, ...] = ("row_tokens",),
                  check_parquet: bool = False) -> dict[str, Any]:
    """The manifest of a built rows directory: the only reader of it. ``require`` names keys that must be present;
    ``check_parquet`` also checks that the parquet file is the one the manifest describes (its sha256)."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (not a built rows directory)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: expected a JSON object")
    for key in require:
        if manifest.get(key) is None:
            raise ValueError(f"{path}: missing field '{key}'")
    for key, least in _COUNTS.items():  # read as sizes by every reader: a float, text or 1e999 is no size
        value = manifest.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{path}: {key}: expected an integer of at least {least}, got {value!r}")
    if check_parquet:
        check_parquet_sha256(parquet_path(directory, manifest), manifest, path)
    return manifest


def parquet_path(directory: str | Path, manifest: dict[str, Any]) -> Path:
    """The rows' parquet file the manifest of ``directory`` names (``parquet_file``): a file name inside it."""
    from openrecipes.utils import path_inside

    return path_inside(directory, manifest.get("parquet_file", ROWS_FILE), source=Path(directory) / MANIFEST_FILE,
                       key="parquet_file", plain_name=True)


def check_parquet_sha256(parquet: Path, manifest: dict[str, Any], manifest_path: Path) -> str:
    """Refuse ``parquet`` unless its sha256 is the manifest's ``parquet_sha256`` (one line naming the file and both
    hashes); return the hash. The file is read once, in chunks, so memory stays flat however big the rows are."""
    from openrecipes.utils import sha256_file

    expected = manifest.get("parquet_sha256")
    if not isinstance(expected, str):
        raise ValueError(f"{manifest_path}: missing field 'parquet_sha256' (the rows cannot be checked)")
    if not parquet.is_file():
        raise FileNotFoundError(f"{parquet} not found (listed in {manifest_path})")
    actual = sha256_file(parquet, chunk_bytes=1 << 24)
    if actual != expected:
        raise ValueError(f"{parquet}: sha256 {actual} is not the parquet_sha256 {expected} of {manifest_path}; "
                         "the rows changed after the build (build them again)")
    return actual


# Beside the manifest of rows a recipe's data.build made (RUN_DIR/rows): the sha256 of each file and directory the
# build read, recorded once the rows are built. The manifest names the input but holds no hash of it, and a resume
# reuses the rows it finds, so an input changed since would otherwise go unnoticed: the run would go on training on
# rows its recipe no longer builds.
BUILD_INPUTS_FILE = "build_inputs.json"
BUILD_INPUTS_FORMAT = "openrecipes.build-inputs.v1"


def input_sha256(path: Path) -> str:
    """The sha256 of a file, or of a directory: over each regular file's relative path and sha256, in sorted order
    (links to directories are not followed)."""
    import os

    from openrecipes.utils import sha256_file

    if not path.is_dir():
        return sha256_file(path, chunk_bytes=1 << 24)
    digest = hashlib.sha256()
    files = sorted(Path(folder, name) for folder, _, names in os.walk(path) for name in names)
    for file in (f for f in files if f.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{sha256_file(file, chunk_bytes=1 << 24)}\n".encode())
    return digest.hexdigest()


def build_inputs(spec: Any) -> dict[str, Path]:
    """What a recipe's ``data.build`` (``config.recipe.DataBuild``) reads, by the recipe key naming each: its input,
    its tokenizer, a chat template file and an image processor."""
    from openrecipes.data import bundled

    inputs = {"data.build.input": bundled.resolve_input(spec.input, spec.format),
              "data.build.tokenizer": bundled.resolve_tokenizer(spec.tokenizer)}
    if spec.chat_template and Path(spec.chat_template).is_file():  # else a built-in template's name
        inputs["data.build.chat_template"] = Path(spec.chat_template)
    if spec.image_processor is not None:
        inputs["data.build.image_processor"] = bundled.resolve(spec.image_processor, bundled.IMAGE_PROCESSOR)
    return inputs


def _recorded_build(path: Path) -> tuple[dict[str, dict[str, str]], dict[str, Any] | None]:
    """The recorded inputs and settings (None: a record from before settings were kept)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        inputs, settings = document["inputs"], document.get("settings")
        if document.get("format") != BUILD_INPUTS_FORMAT or not all(
                isinstance(e, dict) and isinstance(e.get("sha256"), str) for e in inputs.values()) or not (
                settings is None or isinstance(settings, dict)):
            raise ValueError("unexpected content")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: damaged record of the build's inputs ({error})") from None
    return inputs, settings


def _build_settings(spec: Any, input_keys: Iterable[str]) -> dict[str, Any]:
    """``data.build``'s fields other than its input files (those are compared by content, wherever they lie; a
    built-in template's name stays a setting)."""
    files = {key.removeprefix("data.build.") for key in input_keys}
    return {key: value for key, value in spec.model_dump(mode="json").items() if key not in files}


def check_build_inputs(spec: Any, rows: str | Path) -> None:
    """Record, or check, what the rows in ``rows`` were built from (``spec``: the recipe's ``data.build``).

    The first call after the build writes BUILD_INPUTS_FILE; every later one (a resume) refuses with a one-line
    ValueError naming the recipe key and the path of an input whose sha256 is no longer the recorded one. Rows from
    before the record existed get one now. The build's options are the recipe's, which a resume compares itself."""
    from openrecipes.utils import atomic_write_text

    rows = Path(rows)
    record = rows / BUILD_INPUTS_FILE
    paths = build_inputs(spec)
    settings = _build_settings(spec, paths)
    if not record.is_file():
        hashes = {key: {"path": str(path), "sha256": input_sha256(path)} for key, path in paths.items()}
        document = {"format": BUILD_INPUTS_FORMAT, "inputs": hashes, "settings": settings}
        atomic_write_text(record, json.dumps(document, indent=2) + "\n")
        return
    recorded, recorded_settings = _recorded_build(record)
    keys = [*settings, *(k for k in recorded_settings or {} if k not in settings)]  # the recipe's order: format first
    for key in keys if recorded_settings is not None else ():
        if settings.get(key) != recorded_settings.get(key):
            raise ValueError(f"data.build.{key}: the rows in {rows} were built with {key}="
                             f"{json.dumps(recorded_settings.get(key))}, this recipe asks for "
                             f"{json.dumps(settings.get(key))}: they are another build's rows; build these in "
                             "another directory (a new run_dir or --out)")
    for key, path in paths.items():
        before = recorded.get(key, {}).get("sha256")
        now = input_sha256(path) if path.exists() else None
        if now != before:
            raise ValueError(f"{key}: {path} {'has sha256 ' + now if now else 'is missing'}, the rows in {rows} were "
                             f"built from sha256 {before or '(none recorded)'} ({record}): the input changed since "
                             "the run started; restore it, or start a new run to train on what it holds now")
