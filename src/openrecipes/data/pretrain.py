"""``openrecipes data build --format pretrain``: documents -> fixed-length rows of plain language modelling.

Documents are text (a ``text`` field in JSON Lines, a ``text`` column in Parquet or a saved Hugging Face dataset,
read by sources.py) or already tokenized (a Megatron-LM indexed dataset, megatron_indexed.py). In a seeded
permutation each document is tokenized and followed by the end-of-document token; the stream is cut into rows of
exactly ``row_tokens`` by the same packer and writer as SFT rows (packed.py: ``pack_rows``), so the manifest and its
hashes are the same.

Every target is supervised except a document's first token: nothing in its own document predicts it, and the
token before it is the previous document's end (docs/data.md, "Pretraining rows"; the loop's ``loss_weights`` drops
targets at position 0 as well, so the two agree and ``supervised_tokens`` counts exactly the targets trained on).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from openrecipes.data.manifest import MANIFEST_FILE
from openrecipes.data.packed import (MAX_INVALID_EXAMPLES, BuildJob, chunked_pieces, file_fields,
                                     output_guard, pack_rows, record_counts, rows_fields)
from openrecipes.data.megatron_indexed import IndexedDocuments, indexed_prefix, read_indexed
from openrecipes.data.sources import LONE_SURROGATE, ConversationSource, open_source
from openrecipes.data.stream import BATCH_CHARS, Piece, encode_windows, is_long
from openrecipes.data.tokenizer import TokenizerBundle, load_tokenizer
from openrecipes.utils import atomic_write_text, check_output_dir, guarded_output_dir

LOSS_MASK = "pretrain"  # the manifest's loss_mask: every target but a document's first token


class InvalidDocument(ValueError):
    """A record that is not a text document."""


def _check_text(record: Any, where: str, forbidden: re.Pattern[str] | None) -> str:
    """The record's text; ``forbidden`` (added tokens, with ``special_tokens_in_text: refuse``) refuses a text
    quoting one."""
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise InvalidDocument(f"{where}: expected an object with a 'text' string")
    text = record["text"]
    if bad := LONE_SURROGATE.search(text):  # from a "\\udc80" escape: not text any tokenizer can read
        raise InvalidDocument(f"{where}: 'text' holds {bad.group(0)!r}, which is not valid Unicode (a lone "
                              "surrogate)")
    if forbidden is not None and (hit := forbidden.search(text)):
        raise InvalidDocument(f"{where}: 'text' contains the added token {hit.group(0)!r} "
                              "(--special-tokens-in-text refuse)")
    return text


@contextmanager
def _special_tokens_as_text(bundle: TokenizerBundle, policy: str) -> Iterator[None]:
    """With the ``text`` policy an added token quoted in a document is tokenized as text (``split_special_tokens``):
    it can never end the document early, only the appended end token does. A document without one encodes to the
    same ids either way."""
    previous = bundle.tokenizer.encode_special_tokens
    bundle.tokenizer.encode_special_tokens = policy != "refuse"  # a document has no reply: its markers are text
    try:
        yield
    finally:
        bundle.tokenizer.encode_special_tokens = previous


def _end_token(config: BuildJob, bundle: TokenizerBundle) -> tuple[str, int]:
    eos = config.spec.eos_token or bundle.config_token("eos_token")
    if eos is None:
        raise ValueError(f"--tokenizer: {config.tokenizer} names no eos_token in tokenizer_config.json; pass "
                         "--eos-token to say which token ends a document")
    eos_id = bundle.token_id(eos)
    if eos_id is None:
        raise ValueError(f"--eos-token: {config.tokenizer} has no token {eos!r} to end documents")
    return eos, eos_id


def _stream(id_parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Documents (each already ending with its end token) -> ids, masks, document numbers, count."""
    if not id_parts:
        return np.zeros(0, np.int32), np.zeros(0, np.int8), np.zeros(0, np.int64), 0
    lengths = np.array([part.size for part in id_parts], dtype=np.int64)
    ids = np.concatenate(id_parts).astype(np.int32, copy=False)
    mask = np.ones(ids.size, dtype=np.int8)
    mask[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = 0  # a document's first token is not a target
    return ids, mask, np.repeat(np.arange(lengths.size), lengths), int(lengths.size)


def _text_pieces(config: BuildJob, bundle: TokenizerBundle, eos_id: int, source: ConversationSource,
                 order: np.ndarray) -> Iterator[Piece]:
    """Text documents read one at a time in ``order``, encoded in bounded batches, a long one in windows (as SFT
    conversations are: stream.py), each followed by the end token."""
    end = np.array([eos_id], dtype=np.int32)

    def batch(texts: list[str]) -> Piece:
        # encode_batch_fast: no character offsets, which only SFT masks need; the ids are the same
        encodings = bundle.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        ids, mask, doc, count = _stream([np.concatenate([np.asarray(e.ids, dtype=np.int32), end]) for e in encodings])
        return Piece(ids=ids, mask=mask, lengths=np.bincount(doc, minlength=count).astype(np.int64))

    texts: list[str] = []
    chars = 0
    for _, record in source.iter_records(order):
        text = record["text"]  # checked by the scan
        if is_long(text):
            if texts:
                yield batch(texts)
                texts, chars = [], 0
            first = True
            for ids, _ in encode_windows(bundle.tokenizer, text):
                mask = np.ones(ids.size, dtype=np.int8)
                if first:
                    mask[:1] = 0  # a document's first token is not a target
                yield Piece(ids=ids, mask=mask, lengths=np.array([ids.size]), continues=not first)
                first = False
            yield Piece(ids=end, mask=np.ones(1, dtype=np.int8), lengths=np.array([1]), continues=True)
            continue
        texts.append(text)
        chars += len(text)
        if len(texts) >= config.chunk_conversations or chars >= BATCH_CHARS:
            yield batch(texts)
            texts, chars = [], 0
    if texts:
        yield batch(texts)


def _indexed_chunks(documents: IndexedDocuments, eos_id: int, vocab_size: int) -> Any:
    def tokenize(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        parts = []
        for d in indices.tolist():
            tokens = documents.document(d)
            if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
                raise ValueError(f"{documents.prefix}.bin: document {d} holds token id "
                                 f"{int(tokens.max() if tokens.max() >= vocab_size else tokens.min())}, outside "
                                 f"the tokenizer's vocabulary of {vocab_size}")
            # Megatron's preprocess_data.py --append-eod already ends each document with it: never doubled
            if tokens.size == 0 or tokens[-1] != eos_id:
                tokens = np.append(tokens, eos_id)
            parts.append(tokens.astype(np.int32))
        return _stream(parts)

    return tokenize


def build_pretrain(config: BuildJob) -> dict[str, Any]:
    """Build pretraining rows; return the manifest written to ``config.out`` (docs/data.md, "Pretraining rows")."""
    check_output_dir(config.out, **output_guard(config))
    bundle = load_tokenizer(config.tokenizer)
    eos, eos_id = _end_token(config, bundle)
    vocab_size = bundle.tokenizer.get_vocab_size(with_added_tokens=True)
    invalid: list[int] = []
    examples: list[str] = []
    prefix = indexed_prefix(config.input)
    if prefix is not None:
        documents = read_indexed(prefix)
        n_total = len(documents)
        tokenize = _indexed_chunks(documents, eos_id, vocab_size)
        pieces = lambda order: chunked_pieces(order, config.chunk_conversations, tokenize)  # noqa: E731
        source_fields = {"description": f"Megatron indexed dataset {prefix} ({n_total} documents)",
                         "files": [f"{prefix}.idx", f"{prefix}.bin"]}
    else:
        policy = config.chat_input.special_tokens
        forbidden = bundle.marker_pattern() if policy == "refuse" else None
        source, scan = open_source(config.input, column="text")
        for index, where, record in scan:
            try:
                _check_text(record, where, forbidden)
            except InvalidDocument as error:
                if not config.skip_invalid:
                    raise
                invalid.append(index)
                if len(examples) < MAX_INVALID_EXAMPLES:
                    examples.append(str(error))
        n_total = len(source)
        pieces = lambda order: _text_pieces(config, bundle, eos_id, source, order)  # noqa: E731
        source_fields = {"description": source.description, "files": [str(f.path) for f in source.files]}
    order = np.random.default_rng(config.spec.seed).permutation(n_total)
    order = order[~np.isin(order, invalid)]
    if order.size == 0:
        raise ValueError(f"{config.input}: no valid documents")
    with guarded_output_dir(config.out, **output_guard(config)) as staging:
        with _special_tokens_as_text(bundle, config.chat_input.special_tokens):
            packed = pack_rows(config, pieces(order), staging)
        T = config.spec.row_tokens
        manifest = {
            **rows_fields(config, packed.writer),
            "packing": (f"source documents in a seeded global permutation (numpy default_rng({config.spec.seed})"
                        f".permutation over all records), each tokenized and followed by {eos!r} (not doubled "
                        f"when a tokenized document already ends with it), concatenated and cut into consecutive "
                        f"{T:,}-token rows; a document cut by a row boundary continues as a new document in the "
                        "next row; every target is supervised except the first token of each document and of "
                        "each row; no padding"),
            "loss_mask": LOSS_MASK,
            "eos_token": eos,
            "eos_token_id": eos_id,
            "special_tokens_in_text": config.chat_input.special_tokens,
            "tokenizer": {"directory": str(config.tokenizer), "files_sha256": bundle.file_sha256,
                          "vocab_size": vocab_size},
            **file_fields(packed.writer, staging),
            "source": source_fields,
            "counts": record_counts(n_total, len(invalid), packed.doc_lengths, packed.used, packed.packer,
                              noun="documents"),
            "invalid_examples": examples,
        }
        atomic_write_text(staging / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest
