"""``openrecipes data build``: conversations -> fixed-length packed rows + manifest.

Algorithm (docs/data.md): scan and check every input record; shuffle record indices with
``numpy.random.default_rng(seed).permutation``; in that order read and render each valid conversation
with the chat template, tokenize the rendered text at once (the mask from the supervised
character spans: templates.py; a text longer than a window in windows, stream.py), apply the
per-conversation token limit if one is set, append the EOS token; cut the stream into rows of exactly
``row_tokens`` (packing.py); skip rows without a supervised token; stop after
``rows`` kept rows (or at the end of the input); write rows.parquet and manifest.json into a
staging directory that becomes the output directory only on success. Memory stays bounded by one
conversation, one batch and one row group (docs/data.md, "Memory").
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from openrecipes.data.manifest import (FORMAT, MANIFEST_FILE, MAX_TOKEN_ID, ROWS_FILE, ROWS_SHA256_DEFINITION,
                                       RowsWriter)
from openrecipes.data.image_rows import open_images
from openrecipes.data.packing import RowPacker
from openrecipes.data.chat_input import (ChatInput, Shielded, count_skipped, encode_with_text_tokens,
                                         has_marker_characters, shield, text_token_windows)
from openrecipes.data.sources import InvalidConversation, find_token, normalize, open_source
from openrecipes.data.stream import (BATCH_CHARS, TOO_LONG, LimitCounter, Piece, batch_piece,
                                     encode_windows, encoded_piece, is_long, long_pieces)
from openrecipes.data.templates import (LOSS_MASKS, ChatRenderer, builtin_template_note, get_loss_mask,
                                        load_template_text)
from openrecipes.data.tokenizer import load_tokenizer
from openrecipes.utils import atomic_write_text, check_output_dir, guarded_output_dir, sha256_file

MAX_INVALID_EXAMPLES = 20
FORMATS = ("sft", "pretrain")
# marks an output directory as a build's, so --overwrite may replace it (and nothing else)
DATA_MARKER = ".openrecipes-data"
WRITER = "openrecipes data build"


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    input: Path
    tokenizer: Path
    row_tokens: int
    out: Path
    format: str = "sft"  # "sft": conversations with a loss mask; "pretrain": text or token documents (pretrain.py)
    loss_mask: str | None = None  # sft: the loss-mask format (a name of templates.LOSS_MASKS)
    rows: int | None = None
    seed: int = 42
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # built-in name or file; overrides the tokenizer's template
    eos_token: str | None = None  # overrides the loss-mask format's (sft) or tokenizer's (pretrain) separator
    name: str | None = None
    skip_invalid: bool = False  # count invalid conversations instead of failing on the first
    chat_input: ChatInput = field(default_factory=ChatInput)  # how conversations are read (data/chat_input.py)
    overwrite: bool = False
    progress: bool = True
    chunk_conversations: int = 2048
    max_conversation_tokens: int | None = None  # sft: a longer conversation (separator not counted) is ...
    too_long: str = "skip"  # ... skipped (counted) or truncated to its first max_conversation_tokens tokens
    image_processor: Path | None = None  # sft: image parts are read, resized as this preprocessor_config.json says


def _check_config(config: BuildConfig) -> None:
    if config.format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {config.format!r}")
    if config.format == "sft" and config.loss_mask is None:
        raise ValueError(f"--loss-mask is required with --format sft (one of {', '.join(LOSS_MASKS)})")
    if config.format == "pretrain" and (config.loss_mask or config.chat_template or config.template_kwargs):
        raise ValueError("--loss-mask, --chat-template and --template-kwargs apply to --format sft only: "
                         "pretraining rows supervise every target within a document")
    if config.row_tokens <= 0:
        raise ValueError(f"--row-tokens must be positive, got {config.row_tokens}")
    if config.rows is not None and config.rows <= 0:
        raise ValueError(f"--rows must be positive, got {config.rows}")
    if config.chunk_conversations <= 0:
        raise ValueError("chunk_conversations must be positive")
    if config.max_conversation_tokens is not None and config.max_conversation_tokens <= 0:
        raise ValueError(f"--max-conversation-tokens must be positive, got {config.max_conversation_tokens}")
    if config.too_long not in TOO_LONG:
        raise ValueError(f"--too-long must be one of {', '.join(TOO_LONG)}, got {config.too_long!r}")
    if config.too_long != "skip" and config.max_conversation_tokens is None:
        raise ValueError(f"--too-long {config.too_long} needs --max-conversation-tokens N (the limit it applies to)")
    if config.format == "pretrain" and config.max_conversation_tokens is not None:
        raise ValueError("--max-conversation-tokens applies to --format sft only")


def _prepare(config: BuildConfig) -> tuple[Any, ChatRenderer, int, str, str]:
    """Tokenizer, renderer, EOS id and name, template description."""
    bundle = load_tokenizer(config.tokenizer)
    fmt = get_loss_mask(config.loss_mask)
    if config.chat_template is not None:
        template, template_source = load_template_text(config.chat_template)
    elif bundle.chat_template is not None:
        template, template_source = bundle.chat_template, str(bundle.chat_template_source)
    else:
        raise ValueError(f"--tokenizer: {config.tokenizer} has no chat template (no chat_template.jinja and "
                         "no chat_template field in tokenizer_config.json); pass --chat-template")
    for token in fmt.marker_tokens():
        if bundle.token_id(token) is None:
            raise ValueError(f"--tokenizer: {config.tokenizer} has no token {token!r}, which the "
                             f"{fmt.name} loss mask needs")
    eos = config.eos_token or (fmt.separator if bundle.token_id(fmt.separator) is not None
                               else bundle.config_token("eos_token"))
    eos_id = bundle.token_id(eos) if eos else None
    if eos_id is None:
        raise ValueError(f"--eos-token: {config.tokenizer} has no token {eos!r} to separate conversations")
    special = {"bos_token": bundle.config_token("bos_token"), "eos_token": bundle.config_token("eos_token")}
    renderer = ChatRenderer(template=template, loss_mask=fmt, special_tokens=special,
                            template_kwargs=dict(config.template_kwargs))
    # A template that cannot render a minimal conversation in this format is a configuration
    # error, not a property of any one conversation.
    try:
        renderer.pieces([{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}])
    except ValueError as error:
        raise ValueError(f"chat template {template_source} with --loss-mask {fmt.name}: {error} "
                         "(a built-in template can be chosen with --chat-template qwen3|muse_spark)") from None
    return bundle, renderer, eos_id, eos, template_source


def _scan(source_iter: Any, forbidden: Any, skip_invalid: bool, options: ChatInput | None = None,
          reasons: dict[str, Any] | None = None) -> tuple[list[int], list[str]]:
    invalid: list[int] = []
    examples: list[str] = []
    for index, where, record in source_iter:
        try:
            normalize(record, where, forbidden, options)
        except InvalidConversation as error:
            if not skip_invalid:
                raise
            invalid.append(index)
            if reasons is not None:
                count_skipped(reasons, error, where)
            if len(examples) < MAX_INVALID_EXAMPLES:
                examples.append(str(error))
    return invalid, examples


def _sft_pieces(config: BuildConfig, order: np.ndarray, source: Any, renderer: ChatRenderer, tokenizer: Any,
                eos_id: int, forbidden: Any, invalid: list[int], examples: list[str],
                limit: LimitCounter, reasons: dict[str, Any] | None = None, images: Any = None) -> Iterator[Piece]:
    """Render the conversations at ``order`` one at a time; yield their tokens in bounded pieces (stream.py).

    Ordinary conversations are encoded in batches (``chunk_conversations`` of them or ``BATCH_CHARS`` characters),
    each whole, so its ids are the tokenizer's own for the text; one longer than a window goes alone, window by
    window. A conversation whose own strings hold added tokens (kept as text, ``chat_input.special_tokens``) is
    encoded alone, cut at the template's tokens (a long one window by window); one with images alone, whole
    (``images``: image_rows.ImageRows)."""
    options = config.chat_input
    texts: list[str] = []
    spans: list[list[tuple[int, int]]] = []
    chars = 0
    for index, record in source.iter_records(order):
        where = source.where(index)
        try:
            messages, tools = normalize(record, where, forbidden, options)
            numbers = images.take(messages, where) if images is not None else []
            text, supervised, own = _render(renderer, messages, tools, forbidden, options, where)
            if numbers:
                text, supervised, own, numbers = images.expand(text, supervised, own, numbers, where)
        except ValueError as error:  # template errors (raise_exception, wrong format) included
            message = str(error) if str(error).startswith(where) else f"{where}: {error}"
            if not config.skip_invalid:
                raise InvalidConversation(message) from None
            invalid.append(index)
            if reasons is not None:
                count_skipped(reasons, error, where)
            if len(examples) < MAX_INVALID_EXAMPLES:
                examples.append(message)
            continue
        del record, messages, tools  # the rendered text is all that is needed from here on
        if numbers:
            if texts:
                yield from batch_piece(texts, spans, tokenizer, eos_id, limit)
                texts, spans, chars = [], [], 0
            yield from images.pieces(tokenizer, text, supervised, own, forbidden, numbers, eos_id, limit, where)
            continue
        if len(own) or is_long(text):
            if texts:
                yield from batch_piece(texts, spans, tokenizer, eos_id, limit)
                texts, spans, chars = [], [], 0
            if not is_long(text):
                yield from encoded_piece(*encode_with_text_tokens(tokenizer, text, own, forbidden), supervised,
                                         eos_id, limit)
            else:  # window by window: a whole encoding costs a hundred bytes and more a token (stream.py)
                windows = (text_token_windows(tokenizer, text, own, forbidden) if len(own)
                           else encode_windows(tokenizer, text))
                yield from long_pieces(windows, supervised, eos_id, limit)
            continue
        texts.append(text)
        spans.append(supervised)
        chars += len(text)
        if len(texts) >= config.chunk_conversations or chars >= BATCH_CHARS:
            yield from batch_piece(texts, spans, tokenizer, eos_id, limit)
            texts, spans, chars = [], [], 0
    if texts:
        yield from batch_piece(texts, spans, tokenizer, eos_id, limit)


def _render(renderer: ChatRenderer, messages: list[Any], tools: Any, forbidden: Any, options: ChatInput,
            where: str) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """Rendered text, supervised spans, and where the conversation's own added tokens stand (text, not turn,
    reasoning or tool markers: they are kept out of the template's sight while it renders)."""
    if forbidden is None or options.special_tokens != "text" or find_token([messages, tools], "", forbidden) is None:
        return (*renderer.supervised_spans(messages, tools), [])
    if has_marker_characters([messages, tools]):
        raise InvalidConversation(f"{where}: holds the noncharacters U+FDD0/U+FDD1, which mark added tokens "
                                  "while rendering", "marker characters")
    found: list[str] = []
    messages, tools = shield(messages, forbidden, found), shield(tools, forbidden, found)
    return Shielded(found).restore(*renderer.supervised_spans(messages, tools))


def _output_guard(config: BuildConfig) -> dict[str, Any]:
    """``--out`` keeps apart from every file the build reads (utils.check_apart_from_inputs)."""
    inputs = [config.input, config.tokenizer, config.image_processor]
    if config.chat_template and Path(config.chat_template).exists():
        inputs.append(Path(config.chat_template))
    return dict(marker=DATA_MARKER, writer=WRITER, overwrite=config.overwrite, inputs=inputs)


def build(config: BuildConfig) -> dict[str, Any]:
    """Run a build; return the manifest written to ``config.out``."""
    _check_config(config)
    if config.image_processor is not None:
        if config.format != "sft":
            raise ValueError("--image-processor applies to --format sft only")
        config = replace(config, chat_input=replace(config.chat_input, images=True))
    if config.format == "pretrain":
        from openrecipes.data.pretrain import build_pretrain

        return build_pretrain(config)
    check_output_dir(config.out, **_output_guard(config))  # before the work, so a refusal costs nothing
    bundle, renderer, eos_id, eos, template_source = _prepare(config)
    images = open_images(config, bundle, renderer.loss_mask)
    forbidden = bundle.marker_pattern()
    source, scan_iter = open_source(config.input, column=config.chat_input.column)
    reasons: dict[str, Any] = {}
    invalid, examples = _scan(scan_iter, forbidden, config.skip_invalid, config.chat_input, reasons)
    n_total = len(source)
    is_invalid = np.zeros(n_total, dtype=bool)
    is_invalid[invalid] = True
    order = np.random.default_rng(config.seed).permutation(n_total)
    order = order[~is_invalid[order]]
    if order.size == 0:
        raise ValueError(f"{config.input}: no valid conversations")

    limit = LimitCounter(max_tokens=config.max_conversation_tokens, too_long=config.too_long)
    pieces = _sft_pieces(config, order, source, renderer, bundle.tokenizer, eos_id, forbidden, invalid, examples,
                         limit, reasons, images)
    with guarded_output_dir(config.out, **_output_guard(config)) as staging:
        packed = pack_rows(config, pieces, staging, images)
        counts = _counts(n_total, len(invalid), packed.doc_lengths, packed.used, packed.packer,
                         skipped=limit.over_limit if limit.too_long == "skip" else 0)
        if limit.max_tokens is not None:
            counts["conversations_over_token_limit"] = limit.over_limit
        manifest = _manifest(config, bundle, renderer, eos, eos_id, template_source, source, packed.writer,
                             staging, counts, examples, limit)
        manifest.update(chat_input=config.chat_input.to_manifest(), invalid_reasons=reasons)
        if images is not None:
            manifest["images"] = images.finish(staging)
        atomic_write_text(staging / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


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


def pack_rows(config: BuildConfig, pieces: Iterable[Piece], staging: Path, images: Any = None) -> Packed:
    """Cut the stream of ``pieces`` into rows and write them to ``staging``, holding at most one row group.

    The same for every format, so SFT and pretraining rows are packed, hashed and written by one piece of code.
    Documents are numbered in stream order; a piece that ``continues`` extends the previous piece's last one.
    ``images`` (image_rows.ImageRows) records the images each kept row holds.
    """
    from tqdm import tqdm

    T = config.row_tokens
    packer = RowPacker(row_tokens=T, max_rows=config.rows)
    if images is not None:
        images.staging = staging
    doc_lengths: list[np.ndarray] = [np.zeros(0, np.int64)]
    started = 0  # documents begun so far
    used, last_used = 0, -1  # documents in written rows are in stream order: count each new one once
    writer = RowsWriter(staging / ROWS_FILE, T)
    bar = tqdm(total=config.rows * T if config.rows else None, unit="tok", unit_scale=True,
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
    if config.rows is not None and packer.rows_kept < config.rows:
        raise ValueError(f"{config.input}: the input yields only {packer.rows_kept} rows of {T} tokens "
                         f"with a supervised token; --rows asks for {config.rows}")
    if packer.rows_kept == 0:
        raise ValueError(f"{config.input}: the input yields no row of {T} tokens with a supervised token")
    return Packed(writer=writer, packer=packer, doc_lengths=np.concatenate(doc_lengths), used=used)


def _counts(n_total: int, n_invalid: int, doc_lengths: np.ndarray, used: int, packer: RowPacker,
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


def _manifest(config: BuildConfig, bundle: Any, renderer: ChatRenderer, eos: str, eos_id: int,
              template_source: str, source: Any, writer: RowsWriter, staging: Path,
              counts: dict[str, int], examples: list[str], limit: LimitCounter) -> dict[str, Any]:
    T = config.row_tokens
    return {
        **rows_fields(config, writer),
        "packing": (f"source conversations in a seeded global permutation (numpy default_rng({config.seed})"
                    f".permutation over all records), each rendered with the chat template and followed by "
                    f"{eos!r}, concatenated and cut into consecutive {T:,}-token rows; a conversation cut by a "
                    "row boundary continues as a new document in the next row; the first token of each row "
                    "is never a target; rows without supervised targets are skipped; no padding"),
        "loss_mask": renderer.loss_mask.name,
        "eos_token": eos,
        "eos_token_id": eos_id,
        "tokenizer": {"directory": str(config.tokenizer), "files_sha256": bundle.file_sha256,
                      "vocab_size": bundle.tokenizer.get_vocab_size(with_added_tokens=True)},
        "template_source": template_source,
        "template_sha256": hashlib.sha256(renderer.template.encode("utf-8")).hexdigest(),
        "template_kwargs": dict(renderer.template_kwargs),
        "conversation_token_limit": limit.manifest_field(),
        "template_note": builtin_template_note(renderer.template),  # null unless a built-in template's text
        **file_fields(writer, staging),
        "source": {"description": source.description, "files": [str(f.path) for f in source.files]},
        "counts": counts,
        "invalid_examples": examples,
    }


def rows_fields(config: BuildConfig, writer: RowsWriter) -> dict[str, Any]:
    """The manifest's leading fields, the same for every format."""
    tokens = writer.rows * config.row_tokens
    return {
        "format": FORMAT,
        "workflow": config.format,
        "name": config.name or Path(config.out).name,
        "rows": writer.rows,
        "row_tokens": config.row_tokens,
        "tokens": tokens,
        "padding_tokens": 0,
        "supervised_tokens": writer.supervised,
        "supervised_token_ratio": round(writer.supervised / tokens, 6),
        MAX_TOKEN_ID: writer.max_token_id,
        "seed": config.seed,
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


def build_recipe_rows(spec: Any, out: Path) -> Path:
    """Build a recipe's ``data.build`` rows into ``out`` unless a finished build is already there.

    Called once, before the training processes start, so the loop only ever reads rows.
    """
    from openrecipes.data import bundled

    if not (out / MANIFEST_FILE).is_file():
        sft = spec.format == "sft"
        build(BuildConfig(
            input=bundled.resolve_input(spec.input, spec.format),
            tokenizer=bundled.resolve_tokenizer(spec.tokenizer), format=spec.format,
            loss_mask=spec.loss_mask if sft else None, row_tokens=spec.row_tokens, rows=spec.rows, seed=spec.seed,
            template_kwargs=dict(spec.template_kwargs) if sft else {}, chat_template=spec.chat_template if sft else None,
            eos_token=spec.eos_token, max_conversation_tokens=spec.max_conversation_tokens if sft else None,
            too_long=spec.too_long, out=out, progress=False,
            image_processor=None if spec.image_processor is None else bundled.resolve(spec.image_processor,
                                                                                      bundled.IMAGE_PROCESSOR),
            chat_input=ChatInput(shape=spec.input_shape, messages_field=spec.messages_field,
                                 role_map=dict(spec.role_map), special_tokens=spec.special_tokens_in_text)))
    return out
