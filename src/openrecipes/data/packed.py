"""What SFT and pretraining builds share (build.py, pretrain.py): one build job, the packing of a stream of token
pieces into rows, and the manifest fields every format writes."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from openrecipes.config.recipe import DataBuild
from openrecipes.data import bundled
from openrecipes.data.chat_input import ChatInput
from openrecipes.data.manifest import FORMAT, MAX_TOKEN_ID, ROWS_FILE, ROWS_SHA256_DEFINITION, RowsWriter
from openrecipes.data.packing import RowPacker
from openrecipes.data.stream import Piece
from openrecipes.config.rundir import DATA_MARKER
from openrecipes.utils import sha256_file

MAX_INVALID_EXAMPLES = 20
WRITER = "openrecipes data build"


@dataclass(frozen=True, kw_only=True)
class BuildJob:
    """One run of ``data build``: what to build is the recipe's ``data.build`` section (``spec``, the one schema
    of those options, which the CLI's flags fill in too); the rest says where the rows go and how this run behaves
    (neither is a property of the rows)."""

    spec: DataBuild
    out: Path
    name: str | None = None  # the manifest's dataset name (default: the name of ``out``)
    skip_invalid: bool = False  # count invalid records instead of failing on the first
    overwrite: bool = False  # replace an earlier build's output at ``out`` (never another directory)
    progress: bool = True
    chunk_conversations: int = 2048  # records encoded in one batch

    def __post_init__(self) -> None:
        if self.chunk_conversations <= 0:
            raise ValueError(f"chunk_conversations must be positive, got {self.chunk_conversations}")

    @cached_property
    def input(self) -> Path:
        return bundled.resolve_input(self.spec.input, self.spec.format)

    @cached_property
    def tokenizer(self) -> Path:
        return bundled.resolve_tokenizer(self.spec.tokenizer)

    @cached_property
    def image_processor(self) -> Path | None:
        value = self.spec.image_processor
        return None if value is None else bundled.resolve(value, bundled.IMAGE_PROCESSOR)

    @cached_property
    def chat_input(self) -> ChatInput:
        """How conversations are read (data/chat_input.py)."""
        spec = self.spec
        return ChatInput(shape=spec.input_shape, messages_field=spec.messages_field, role_map=dict(spec.role_map),
                         special_tokens=spec.special_tokens_in_text, images=self.image_processor is not None)


def output_guard(config: BuildJob) -> dict[str, Any]:
    """``--out`` keeps apart from every file the build reads (utils.check_apart_from_inputs)."""
    inputs = [config.input, config.tokenizer, config.image_processor]
    if config.spec.chat_template and Path(config.spec.chat_template).exists():
        inputs.append(Path(config.spec.chat_template))
    return dict(marker=DATA_MARKER, writer=WRITER, overwrite=config.overwrite, inputs=inputs)


@dataclass(kw_only=True)
class Packed:
    writer: RowsWriter
    packer: RowPacker
    doc_lengths: np.ndarray  # per reached document, its tokens (separator included), in stream order
    used: int  # documents with a token in a written row


def chunked_pieces(order: np.ndarray, chunk: int,
                   tokenize: Any) -> Iterator[Piece]:
    """Pieces from a ``tokenize(indices) -> (ids, masks, chunk-local document numbers, count)`` per chunk."""
    for start in range(0, order.size, chunk):
        ids, mask, doc, n_docs = tokenize(order[start:start + chunk])
        if n_docs:
            yield Piece(ids=ids, mask=mask, lengths=np.bincount(doc, minlength=n_docs).astype(np.int64))


def pack_rows(config: BuildJob, pieces: Iterable[Piece], staging: Path, images: Any = None) -> Packed:
    """Cut the stream of ``pieces`` into rows and write them to ``staging``, holding at most one row group.

    The same for every format, so SFT and pretraining rows are packed, hashed and written by one piece of code.
    Documents are numbered in stream order; a piece that ``continues`` extends the previous piece's last one.
    ``images`` (image_rows.ImageRows) records the images each kept row holds.
    """
    from tqdm import tqdm

    T = config.spec.row_tokens
    packer = RowPacker(row_tokens=T, max_rows=config.spec.rows)
    if images is not None:
        images.staging = staging
    doc_lengths: list[np.ndarray] = [np.zeros(0, np.int64)]
    started = 0  # documents begun so far
    used, last_used = 0, -1  # documents in written rows are in stream order: count each new one once
    writer = RowsWriter(staging / ROWS_FILE, T)
    bar = tqdm(total=config.spec.rows * T if config.spec.rows else None, unit="tok", unit_scale=True,
               disable=not config.progress, file=sys.stderr, mininterval=1.0, desc="data build")
    try:
        for piece in pieces:
            first = started - 1 if piece.continues else started
            doc = np.repeat(np.arange(first, first + piece.lengths.size), piece.lengths)
            new = piece.lengths.astype(np.int64)  # a copy: the last entry may grow
            if piece.continues:
                doc_lengths[-1][-1] += new[0]
                new = new[1:]
            if new.size:
                doc_lengths.append(new)
            started = first + piece.lengths.size
            aux = None
            if images is not None:  # every piece's tokens carry their image numbers (text: -1)
                aux = piece.images if piece.images is not None else np.full(piece.ids.size, -1, np.int64)
            block = packer.push(piece.ids, piece.mask, doc, aux)
            if images is not None:
                images.record(block.aux, first_row=writer.rows)
            writer.add(block.input_ids, block.loss_mask, block.doc_lens)
            if block.doc_index:
                in_rows = np.unique(np.concatenate(block.doc_index))
                used += int(np.count_nonzero(in_rows > last_used))
                last_used = int(in_rows[-1])
            bar.update(block.input_ids.size)
            if packer.done:
                break
    finally:
        if hasattr(pieces, "close"):
            pieces.close()  # a generator stopped early closes its input files now
        writer.close()
        bar.close()
    if config.spec.rows is not None and packer.rows_kept < config.spec.rows:
        raise ValueError(f"{config.input}: the input yields only {packer.rows_kept} rows of {T} tokens "
                         f"with a supervised token; --rows asks for {config.spec.rows}")
    if packer.rows_kept == 0:
        raise ValueError(f"{config.input}: the input yields no row of {T} tokens with a supervised token")
    return Packed(writer=writer, packer=packer, doc_lengths=np.concatenate(doc_lengths), used=used)


def record_counts(n_total: int, n_invalid: int, doc_lengths: np.ndarray, used: int, packer: RowPacker,
            noun: str = "conversations", skipped: int = 0) -> dict[str, int]:
    """How the input's records (``noun``: conversations or documents) fell into the rows (docs/data.md).

    ``skipped``: valid records left out of the stream (over the token limit)."""
    T = packer.row_tokens
    ends = np.cumsum(doc_lengths)
    starts = ends - doc_lengths
    stop = packer.last_kept_end  # stream position after the last kept row
    first_cut = (starts // T + 1) * T  # first row boundary after a document's start
    return {
        f"{noun}_total": n_total,
        f"{noun}_invalid": n_invalid,
        f"{noun}_used": used,
        f"{noun}_split": int(np.count_nonzero((first_cut < ends) & (first_cut < stop))),
        f"{noun}_truncated": int(np.count_nonzero((starts < stop) & (ends > stop))),
        f"{noun}_unused": int(n_total - n_invalid - skipped - np.count_nonzero(starts < stop)),
        "rows_skipped_unsupervised": int(packer.rows_skipped),
        "tokens_in_rows_skipped_unsupervised": int(packer.rows_skipped) * T,
        "tokens_dropped_after_last_row": int(ends[-1] - stop) if ends.size else 0,
    }


def rows_fields(config: BuildJob, writer: RowsWriter) -> dict[str, Any]:
    """The manifest's leading fields, the same for every format."""
    tokens = writer.rows * config.spec.row_tokens
    return {
        "format": FORMAT,
        "workflow": config.spec.format,
        "name": config.name or Path(config.out).name,
        "rows": writer.rows,
        "row_tokens": config.spec.row_tokens,
        "tokens": tokens,
        "padding_tokens": 0,
        "supervised_tokens": writer.supervised,
        "supervised_token_ratio": round(writer.supervised / tokens, 6),
        MAX_TOKEN_ID: writer.max_token_id,
        "seed": config.spec.seed,
    }


def file_fields(writer: RowsWriter, staging: Path) -> dict[str, Any]:
    """The manifest's hashes of the rows and of the parquet file, the same for every format."""
    return {
        "rows_sha256": writer.rows_sha256,
        "rows_sha256_definition": ROWS_SHA256_DEFINITION,
        "parquet_file": ROWS_FILE,
        "parquet_sha256": sha256_file(staging / ROWS_FILE),
        "parquet_bytes": (staging / ROWS_FILE).stat().st_size,
        "columns": {"input_ids": "list<int32>", "loss_mask": "list<int8>", "doc_lens": "list<int32>"},
    }
