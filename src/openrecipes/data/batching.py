"""The trainer's side of the rows: a reader, data-parallel sharding and THD microbatches.

Global batch ``step`` is rows ``(step * G + j) % N`` for ``j`` in ``0..G-1`` (G = global batch
rows, N = rows in the file; the file is already shuffled at build time, so reading in order is
the schedule; it wraps into the next epoch). Data-parallel rank ``r`` of ``d`` gets positions
``j = r, r + d, r + 2d, ...`` of that list (a strided split; G must be divisible by d). A rank
packs its rows, in order, into microbatches of ``rows_per_microbatch`` whole rows (the layout decides how
many: ``openrecipes.config.layout.rows_per_microbatch``); the last one may hold fewer.

A microbatch is a dict of tensors, B rows of T tokens:
  input_ids     (B, T) int64
  loss_mask     (B, T) int64  1 where token t is a target (predicted from position t-1)
  position_ids  (B, T) int64  0 at each document start, counting up within the document
  document_ids  (B, T) int64  0, 1, ... per document piece within a row
  cu_seqlens    (D+1,) int32  document boundaries over the flattened B*T tokens (varlen attention)
  max_seqlen    ()      int32 longest document piece in the microbatch
Attention must never cross a ``cu_seqlens`` boundary. Rows built with images add the image inputs of image_batch.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from openrecipes.data.manifest import MANIFEST_FILE, ROWS_FILE, check_parquet_sha256, read_manifest


@dataclass(frozen=True, kw_only=True)
class RowsDataset:
    """All rows of a rows.parquet in memory as flat numpy arrays."""

    input_ids: np.ndarray  # (N, T) int32
    loss_mask: np.ndarray  # (N, T) int8
    doc_offsets: np.ndarray  # (N+1,) int64 into doc_lens_flat
    doc_lens_flat: np.ndarray  # int32
    images: Any = None  # image_batch.RowImages of rows built with images, else None

    @property
    def row_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def one_document_per_row(self) -> bool:
        """Whether every row holds one document (no packing)."""
        return bool(np.all(np.diff(self.doc_offsets) == 1))

    def doc_lens(self, row: int) -> np.ndarray:
        return self.doc_lens_flat[self.doc_offsets[row]:self.doc_offsets[row + 1]]


_ROW_COLUMNS = ["input_ids", "loss_mask", "doc_lens"]


def _rows_parquet(path: str | Path) -> tuple[Path, int | None, dict[str, Any] | None]:
    """The parquet file of rows at ``path`` (a build output directory or the file itself), the row length and the
    manifest a directory has; the parquet file is first checked against the manifest's ``parquet_sha256``."""
    path = Path(path)
    if not path.is_dir():
        return path, None, None
    manifest = None
    expected_T = None
    if (path / MANIFEST_FILE).is_file():
        manifest = read_manifest(path)
        expected_T = int(manifest["row_tokens"])
        check_parquet_sha256(path / ROWS_FILE, manifest, path / MANIFEST_FILE)
    return path / ROWS_FILE, expected_T, manifest


def _unreadable(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path}: not a readable rows parquet file ({' '.join(str(error).split())})")


def check_rows_files(path: str | Path) -> None:
    """Refuse, in one line, rows whose files ``load_rows`` would refuse before reading a row: a changed parquet file
    (its sha256), one that does not open as parquet or lacks a rows column. Reads the footer, not the rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet, _, _ = _rows_parquet(path)
    if not parquet.is_file():
        raise FileNotFoundError(f"{parquet} not found")
    try:
        names = set(pq.ParquetFile(str(parquet)).schema_arrow.names)
    except (pa.ArrowException, OSError) as error:
        raise _unreadable(parquet, error) from None
    missing = [column for column in _ROW_COLUMNS if column not in names]
    if missing:
        raise ValueError(f"{parquet}: not a rows parquet file (no column(s) {missing})")


def load_rows(path: str | Path) -> RowsDataset:
    """Read a build output directory (or a rows.parquet file) and check its shape. A directory with a manifest has
    its parquet file checked against the manifest's ``parquet_sha256`` first, so changed rows never train."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(path)
    path, expected_T, manifest = _rows_parquet(directory)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        table = pq.read_table(str(path), columns=_ROW_COLUMNS)
    except (pa.ArrowException, OSError) as error:  # a damaged file, or one without the rows' columns
        raise _unreadable(path, error) from None
    n = table.num_rows
    if n == 0:
        raise ValueError(f"{path}: no rows")
    ids_col = table.column("input_ids").combine_chunks()
    mask_col = table.column("loss_mask").combine_chunks()
    lens_col = table.column("doc_lens").combine_chunks()
    ids = ids_col.flatten().to_numpy()
    mask = mask_col.flatten().to_numpy()
    T = expected_T or ids.size // n
    if ids.size != n * T or mask.size != n * T or np.any(np.diff(ids_col.offsets.to_numpy()) != T):
        raise ValueError(f"{path}: rows are not all {T} tokens long")
    doc_offsets = lens_col.offsets.to_numpy().astype(np.int64)
    doc_flat = lens_col.flatten().to_numpy().astype(np.int32)
    if doc_flat.size == 0 or np.any(doc_flat <= 0) or np.any(np.diff(doc_offsets) <= 0):
        raise ValueError(f"{path}: doc_lens must hold positive lengths for every row")
    sums = np.add.reduceat(doc_flat.astype(np.int64), doc_offsets[:-1])
    if np.any(sums != T):
        raise ValueError(f"{path}: doc_lens of row {int(np.flatnonzero(sums != T)[0])} do not sum to {T}")
    images = None
    if manifest is not None and manifest.get("images"):
        from openrecipes.data.image_batch import load_row_images

        images = load_row_images(directory, manifest, ids.reshape(n, T))
    return RowsDataset(input_ids=ids.reshape(n, T), loss_mask=mask.reshape(n, T),
                       doc_offsets=doc_offsets, doc_lens_flat=doc_flat, images=images)


def global_batch_rows(step: int, global_batch: int, num_rows: int) -> np.ndarray:
    """Row indices of global batch ``step`` (wrapping over epochs)."""
    if global_batch <= 0 or step < 0:
        raise ValueError("global_batch must be positive and step non-negative")
    return (np.arange(global_batch, dtype=np.int64) + step * global_batch) % num_rows


def shard_rows(rows: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """Rank ``dp_rank``'s rows of a global batch: positions dp_rank, dp_rank + dp_size, ..."""
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
    if rows.size % dp_size:
        raise ValueError(f"global batch of {rows.size} rows does not divide over {dp_size} data-parallel ranks")
    return rows[dp_rank::dp_size]


def attention_sum_sq(doc_lens: np.ndarray | Any) -> int:
    """Σ s_i² over documents (causal attention work scales with it)."""
    lens = np.asarray(doc_lens, dtype=np.int64).reshape(-1)
    return int(np.dot(lens, lens))


def make_microbatch(dataset: RowsDataset, rows: np.ndarray) -> dict[str, Any]:
    """Stack ``rows`` into one THD microbatch (see the module docstring)."""
    import torch

    B, T = rows.size, dataset.row_tokens
    lens_per_row = [dataset.doc_lens(int(r)) for r in rows]
    counts = np.array([x.size for x in lens_per_row], dtype=np.int64)
    lens = np.concatenate(lens_per_row).astype(np.int64)
    cu = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    flat_position = np.arange(B * T, dtype=np.int64)
    position_ids = flat_position - np.repeat(cu[:-1], lens)
    first_doc_of_row = np.concatenate([[0], np.cumsum(counts)[:-1]])
    document_ids = np.repeat(np.arange(lens.size), lens) - np.repeat(first_doc_of_row, T)
    return {
        **(dataset.images.microbatch(rows) if dataset.images is not None else {}),
        "input_ids": torch.from_numpy(dataset.input_ids[rows].astype(np.int64)),
        "loss_mask": torch.from_numpy(dataset.loss_mask[rows].astype(np.int64)),
        "position_ids": torch.from_numpy(position_ids.reshape(B, T)),
        "document_ids": torch.from_numpy(document_ids.reshape(B, T)),
        "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
        "max_seqlen": torch.tensor(int(lens.max()), dtype=torch.int32),
    }


@dataclass(kw_only=True)
class RowLoader:
    """Deterministic per-rank microbatches for each optimizer step."""

    dataset: RowsDataset
    global_batch: int
    dp_rank: int
    dp_size: int
    rows_per_microbatch: int  # from openrecipes.config.layout.rows_per_microbatch

    def __post_init__(self) -> None:
        if self.rows_per_microbatch < 1:
            raise ValueError(f"rows_per_microbatch must be positive, got {self.rows_per_microbatch}")
        if self.global_batch % self.dp_size:
            raise ValueError(f"global_batch {self.global_batch} is not divisible by dp_size {self.dp_size}")
        shard_rows(np.zeros(self.dp_size, dtype=np.int64), self.dp_rank, self.dp_size)  # checks the rank

    def rank_rows(self, step: int) -> np.ndarray:
        return shard_rows(global_batch_rows(step, self.global_batch, len(self.dataset)), self.dp_rank, self.dp_size)

    def microbatches(self, step: int) -> list[dict[str, Any]]:
        rows = self.rank_rows(step)
        k = self.rows_per_microbatch
        return [make_microbatch(self.dataset, rows[i:i + k]) for i in range(0, rows.size, k)]

    def steps(self, first: int, count: int) -> Iterator[list[dict[str, Any]]]:
        for step in range(first, first + count):
            yield self.microbatches(step)
