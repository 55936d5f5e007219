"""Cut a stream of tokenized documents into fixed-length rows (numpy, no per-token loops).

Documents (conversation + EOS) are appended in order; the stream is cut every ``row_tokens``
tokens. A document cut by a row boundary continues as a new document at the start of the
next row. The first token of every row is never a target (nothing before it in the row can
predict it), so its mask is set to 0. Rows left without a supervised token are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True)
class RowBlock:
    """Kept rows from one ``push``: (R, T) arrays plus each row's document lengths."""

    input_ids: np.ndarray  # (R, T) int32
    loss_mask: np.ndarray  # (R, T) int8
    doc_lens: list[np.ndarray]  # R arrays of int32, each summing to T
    doc_index: list[np.ndarray]  # R arrays: stream index of each document piece
    aux: np.ndarray | None = None  # (R, T) int64: the per-token values pushed with the tokens (image tokens), if any


@dataclass(kw_only=True)
class RowPacker:
    row_tokens: int
    max_rows: int | None = None
    rows_kept: int = 0
    rows_skipped: int = 0
    rows_produced: int = 0
    _ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    _mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    _doc: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _aux: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_kept_end: int = 0  # stream position just after the last kept row

    @property
    def done(self) -> bool:
        return self.max_rows is not None and self.rows_kept >= self.max_rows

    def push(self, ids: np.ndarray, mask: np.ndarray, doc: np.ndarray, aux: np.ndarray | None = None) -> RowBlock:
        """Append tokens (ids, per-token mask, per-token document index and, in a build that has them, a per-token
        value cut into rows with them: ``aux``); return the full rows kept."""
        T = self.row_tokens
        ids = np.concatenate([self._ids, ids.astype(np.int32, copy=False)])
        mask = np.concatenate([self._mask, mask.astype(np.int8, copy=False)])
        doc = np.concatenate([self._doc, doc.astype(np.int64, copy=False)])
        n_rows = ids.size // T
        used = n_rows * T
        self._ids, self._mask, self._doc = ids[used:], mask[used:], doc[used:]
        ids_RT = ids[:used].reshape(n_rows, T)
        mask_RT = mask[:used].reshape(n_rows, T).copy()
        doc_RT = doc[:used].reshape(n_rows, T)
        aux_RT = None
        if aux is not None:
            aux = np.concatenate([self._aux, aux.astype(np.int64, copy=False)])
            self._aux, aux_RT = aux[used:], aux[:used].reshape(n_rows, T)
        mask_RT[:, 0] = 0
        keep = np.flatnonzero(mask_RT.any(axis=1))
        first_row = self.rows_produced
        if self.max_rows is not None:
            keep = keep[: self.max_rows - self.rows_kept]
            if self.rows_kept + keep.size >= self.max_rows and keep.size:
                # rows after the last kept one were never needed: they are not "produced"
                n_rows = int(keep[-1]) + 1
        self.rows_skipped += n_rows - keep.size
        self.rows_produced += n_rows
        self.rows_kept += keep.size
        if keep.size:
            self.last_kept_end = (first_row + int(keep[-1]) + 1) * T
        doc_lens, doc_index = _row_documents(doc_RT[keep])
        return RowBlock(input_ids=ids_RT[keep], loss_mask=mask_RT[keep], doc_lens=doc_lens, doc_index=doc_index,
                        aux=None if aux_RT is None else aux_RT[keep])


def _row_documents(doc_RT: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per row: lengths and stream indices of the document pieces, in order."""
    if doc_RT.shape[0] == 0:
        return [], []
    R, T = doc_RT.shape
    starts = np.ones((R, T), dtype=bool)
    starts[:, 1:] = doc_RT[:, 1:] != doc_RT[:, :-1]
    row, col = np.nonzero(starts)  # row-major order: pieces in stream order
    ends = np.append(col[1:], T)
    ends[np.flatnonzero(np.diff(row))] = T  # the last piece of each row ends at T
    lengths = (ends - col).astype(np.int32)
    counts = np.bincount(row, minlength=R)
    split_at = np.cumsum(counts)[:-1]
    return np.split(lengths, split_at), np.split(doc_RT[row, col], split_at)
