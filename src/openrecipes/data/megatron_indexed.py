"""Read Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``): already-tokenized documents.

Our own reader of the format Megatron-LM's ``megatron/core/datasets/indexed_dataset.py`` writes
(``IndexedDatasetBuilder``), read from its description, not copied. The ``.idx`` file, little-endian:

  9 bytes   header b"MMIDIDX\\x00\\x00"
  u64       version, 1
  u8        dtype code of the tokens in .bin: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
            7 float32, 8 uint16
  u64       S, the number of sequences
  u64       D, the number of entries in the document index (documents + 1)
  int32[S]  tokens per sequence
  int64[S]  byte offset of each sequence in .bin
  int64[D]  document index: document d is sequences [index[d], index[d+1]); index[0] = 0, index[-1] = S
  int8[S]   (multimodal datasets only) the mode of each sequence; ignored here

The ``.bin`` file is the sequences' tokens back to back in that dtype. A document of several sequences (Megatron's
sentence splitting) is read as their concatenation. Every size and offset is checked against the file sizes, so a
truncated or foreign file is an error naming it, never a silent misread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
_PREAMBLE = len(HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, S, D: 34 bytes
DTYPES: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                        6: np.float64, 7: np.float32, 8: np.uint16}


def indexed_prefix(path: str | Path) -> Path | None:
    """The dataset prefix when ``path`` names a Megatron indexed dataset (PREFIX, PREFIX.bin or PREFIX.idx)."""
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if prefix.with_name(prefix.name + ".idx").is_file() or path.suffix in (".bin", ".idx"):
        return prefix
    return None


@dataclass(frozen=True, kw_only=True)
class IndexedDocuments:
    """The documents of one indexed dataset; ``document(d)`` gives document d's tokens as int64."""

    prefix: Path
    tokens: np.ndarray  # memory-mapped .bin, flat, in the dataset's dtype
    sequence_starts: np.ndarray  # int64 token offset of each sequence
    sequence_lengths: np.ndarray  # int64
    document_index: np.ndarray  # int64, documents + 1 entries

    def __len__(self) -> int:
        return int(self.document_index.size - 1)

    def document_lengths(self) -> np.ndarray:
        """Tokens per document."""
        ends = np.concatenate([[0], np.cumsum(self.sequence_lengths)])
        return ends[self.document_index[1:]] - ends[self.document_index[:-1]]

    def document(self, d: int) -> np.ndarray:
        first, last = int(self.document_index[d]), int(self.document_index[d + 1])
        if first == last:
            return np.zeros(0, dtype=np.int64)
        start = int(self.sequence_starts[first])
        contiguous = last - first == 1 or bool(np.all(
            self.sequence_starts[first + 1:last] == self.sequence_starts[first:last - 1]
            + self.sequence_lengths[first:last - 1]))
        if contiguous:  # the usual case: one read of the whole document
            stop = int(self.sequence_starts[last - 1] + self.sequence_lengths[last - 1])
            return self.tokens[start:stop].astype(np.int64)
        return np.concatenate([self.tokens[int(s):int(s + n)] for s, n in zip(
            self.sequence_starts[first:last], self.sequence_lengths[first:last])]).astype(np.int64)


def read_indexed(path: str | Path) -> IndexedDocuments:
    """Open ``PREFIX.idx`` and ``PREFIX.bin``; raise ValueError naming the file and the field at fault."""
    prefix = indexed_prefix(path) or Path(path)
    idx, bin_ = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    for file in (idx, bin_):
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found (a Megatron indexed dataset is PREFIX.bin + PREFIX.idx)")
    raw = np.fromfile(idx, dtype=np.uint8)
    if raw.size < _PREAMBLE or raw[:len(HEADER)].tobytes() != HEADER:
        raise ValueError(f"{idx}: not a Megatron indexed dataset index (header is not {HEADER!r})")
    version, code, n_seq, n_doc_index = struct.unpack_from("<QBQQ", raw, len(HEADER))
    if version != 1:
        raise ValueError(f"{idx}: index version {version}; only version 1 is known")
    if code not in DTYPES:
        raise ValueError(f"{idx}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    dtype = np.dtype(DTYPES[code])
    if dtype.kind == "f":
        raise ValueError(f"{idx}: dtype code {code} ({dtype}) holds floats, not token ids")
    body = 4 * n_seq + 8 * n_seq + 8 * n_doc_index
    if raw.size not in (_PREAMBLE + body, _PREAMBLE + body + n_seq):  # + the multimodal modes
        raise ValueError(f"{idx}: {raw.size} bytes, but {n_seq} sequences and {n_doc_index} document-index "
                         f"entries need {_PREAMBLE + body} (or {_PREAMBLE + body + n_seq} with modes)")
    offset = _PREAMBLE
    lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=offset).astype(np.int64)
    offset += 4 * n_seq
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=offset).astype(np.int64)
    offset += 8 * n_seq
    doc_index = np.frombuffer(raw, dtype="<i8", count=n_doc_index, offset=offset).astype(np.int64)
    if n_doc_index < 1 or doc_index[0] != 0 or doc_index[-1] != n_seq or np.any(np.diff(doc_index) < 0):
        raise ValueError(f"{idx}: the document index must rise from 0 to the sequence count {n_seq}")
    if np.any(lengths < 0) or np.any(pointers < 0) or np.any(pointers % dtype.itemsize):
        raise ValueError(f"{idx}: negative sequence lengths or pointers, or pointers not aligned to {dtype} tokens")
    bin_bytes = bin_.stat().st_size
    # pointers first: a pointer near 2**63 would wrap the sum below round to a negative end
    if n_seq and (int(pointers.max()) > bin_bytes or int((pointers + lengths * dtype.itemsize).max()) > bin_bytes):
        raise ValueError(f"{bin_}: {bin_bytes} bytes, but {idx} points past its end")
    count = bin_bytes // dtype.itemsize  # a trailing partial token is never pointed at (checked above)
    tokens = (np.memmap(bin_, dtype=dtype.newbyteorder("<"), mode="r", shape=(count,)) if count
              else np.zeros(0, dtype=dtype))
    return IndexedDocuments(prefix=prefix, tokens=tokens, sequence_starts=pointers // dtype.itemsize,
                            sequence_lengths=lengths, document_index=doc_index)
