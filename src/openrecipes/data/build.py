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
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from openrecipes.config.recipe import DataBuild, data_build_flag
from openrecipes.data.chat_input import (ChatInput, Markers, Shielded, count_skipped, encode_with_text_tokens,
                                         has_marker_characters, shield_conversation, text_token_windows)
from openrecipes.data.image_rows import open_images
from openrecipes.data.manifest import MANIFEST_FILE, RowsWriter, check_build_inputs
from openrecipes.data.packed import (MAX_INVALID_EXAMPLES, BuildJob, file_fields, output_guard, pack_rows,
                                     record_counts, rows_fields)
from openrecipes.data.pretrain import build_pretrain
from openrecipes.data.sources import LONE_SURROGATE, InvalidConversation, find_marker, normalize, open_source
from openrecipes.data.stream import (BATCH_CHARS, LimitCounter, Piece, batch_piece, encode_windows, encoded_piece,
                                     is_long, long_pieces)
from openrecipes.data.templates import (TEMPLATE_SPECIAL_TOKENS, ChatRenderer, builtin_template_note, get_loss_mask,
                                        load_template_text)
from openrecipes.data.tokenizer import load_tokenizer
from openrecipes.utils import atomic_write_text, check_output_dir, guarded_output_dir


def _prepare(config: BuildJob) -> tuple[Any, ChatRenderer, int, str, str]:
    """Tokenizer, renderer, EOS id and name, template description."""
    bundle = load_tokenizer(config.tokenizer)
    fmt = get_loss_mask(config.spec.loss_mask)
    if config.spec.chat_template is not None:
        template, template_source = load_template_text(config.spec.chat_template)
    elif bundle.chat_template is not None:
        template, template_source = bundle.chat_template, str(bundle.chat_template_source)
    else:
        raise ValueError(f"--tokenizer: {config.tokenizer} has no chat template (no chat_template.jinja and "
                         "no chat_template field in tokenizer_config.json); pass --chat-template")
    for token in fmt.marker_tokens():
        if bundle.token_id(token) is None:
            raise ValueError(f"--tokenizer: {config.tokenizer} has no token {token!r}, which the "
                             f"{fmt.name} loss mask needs")
    eos = config.spec.eos_token or (fmt.separator if bundle.token_id(fmt.separator) is not None
                               else bundle.config_token("eos_token"))
    eos_id = bundle.token_id(eos) if eos else None
    if eos_id is None:
        raise ValueError(f"--eos-token: {config.tokenizer} has no token {eos!r} to separate conversations")
    # the named tokens apply_chat_template gives the template (its special_tokens_map): only those the tokenizer sets,
    # so that `{{ bos_token }}` of a tokenizer without one writes nothing, not "None"
    special = {key: token for key in TEMPLATE_SPECIAL_TOKENS if (token := bundle.config_token(key)) is not None}
    renderer = ChatRenderer(template=template, loss_mask=fmt, special_tokens=special,
                            template_kwargs=dict(config.spec.template_kwargs))
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


def _sft_pieces(config: BuildJob, order: np.ndarray, source: Any, renderer: ChatRenderer, tokenizer: Any,
                eos_id: int, forbidden: Markers | None, invalid: list[int], examples: list[str],
                limit: LimitCounter, reasons: dict[str, Any] | None = None, images: Any = None) -> Iterator[Piece]:
    """Render the conversations at ``order`` one at a time; yield their tokens in bounded pieces (stream.py).

    Ordinary conversations are encoded in batches (``chunk_conversations`` of them or ``BATCH_CHARS`` characters),
    each whole, so its ids are the tokenizer's own for the text; one longer than a window goes alone, window by
    window. A conversation whose own strings hold added tokens (kept as text, ``chat_input.special_tokens``) is
    encoded alone, cut at the template's tokens (a long one window by window); one with images alone, whole
    (``images``: image_rows.ImageRows)."""
    options = config.chat_input
    added = forbidden.anywhere if forbidden is not None else None  # the tokens the text is cut at when encoded
    texts: list[str] = []
    spans: list[list[tuple[int, int]]] = []
    chars = 0
    for index, record in source.iter_records(order):
        where = source.where(index)
        try:
            messages, tools = normalize(record, where, forbidden, options)
            numbers = images.take(messages, where) if images is not None else []
            text, supervised, own = _rendered(_render(renderer, messages, tools, forbidden, options, where))
            if numbers:
                text, supervised, own, numbers = images.expand(text, supervised, own, numbers, where)
        except (ValueError, RecursionError) as error:  # template errors (raise_exception, wrong format) included
            if isinstance(error, RecursionError):  # under the reader's bound, but too deep for the renderer
                error = InvalidConversation("a field is nested too deeply to render", "nested too deeply")
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
            yield from images.pieces(tokenizer, text, supervised, own, added, numbers, eos_id, limit, where)
            continue
        if len(own) or is_long(text):
            if texts:
                yield from batch_piece(texts, spans, tokenizer, eos_id, limit)
                texts, spans, chars = [], [], 0
            if not is_long(text):
                yield from encoded_piece(*encode_with_text_tokens(tokenizer, text, own, added), supervised,
                                         eos_id, limit)
            else:  # window by window: a whole encoding costs a hundred bytes and more a token (stream.py)
                windows = (text_token_windows(tokenizer, text, own, added) if len(own)
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


def _render(renderer: ChatRenderer, messages: list[Any], tools: Any, markers: Markers | None, options: ChatInput,
            where: str) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """Rendered text, supervised spans, and where the conversation's own added tokens stand (text, not turn,
    reasoning or tool markers: they are kept out of the template's sight while it renders), but a reply's own
    reasoning and tool-call markers, which reach the template as apply_chat_template passes them."""
    if markers is None or options.special_tokens == "refuse" or find_marker(messages, tools, markers) is None:
        return (*renderer.supervised_spans(messages, tools), [])
    if has_marker_characters([messages, tools]):
        raise InvalidConversation(f"{where}: holds the noncharacters U+FDD0/U+FDD1, which mark added tokens "
                                  "while rendering", "marker characters")
    found: list[str] = []
    messages, tools = shield_conversation(messages, tools, markers, found)
    return Shielded(found).restore(*renderer.supervised_spans(messages, tools))


def _rendered(rendered: tuple[str, Any, Any]) -> tuple[str, Any, Any]:
    """The template's output, refused when it is not text a tokenizer reads (a template writing a lone surrogate)."""
    if bad := LONE_SURROGATE.search(rendered[0]):
        raise ValueError(f"the chat template's output holds {bad.group(0)!r}, which is not valid Unicode (a lone "
                         "surrogate)")
    return rendered


def build(spec: DataBuild, out: Path, **options: Any) -> dict[str, Any]:
    """Build the rows ``spec`` (the recipe's ``data.build``) describes into ``out``; return the manifest written there.
    ``options``: the rest of a ``BuildJob`` (name, skip_invalid, overwrite, progress, chunk_conversations)."""
    job = BuildJob(spec=spec, out=Path(out), **options)
    return build_pretrain(job) if spec.format == "pretrain" else _build_sft(job)


def _build_sft(config: BuildJob) -> dict[str, Any]:
    check_output_dir(config.out, **output_guard(config))  # before the work, so a refusal costs nothing
    bundle, renderer, eos_id, eos, template_source = _prepare(config)
    images = open_images(config, bundle, renderer.loss_mask)
    forbidden = Markers.of(bundle, renderer.loss_mask, config.chat_input.special_tokens)
    source, scan_iter = open_source(config.input, column=config.chat_input.column)
    reasons: dict[str, Any] = {}
    invalid, examples = _scan(scan_iter, forbidden, config.skip_invalid, config.chat_input, reasons)
    n_total = len(source)
    is_invalid = np.zeros(n_total, dtype=bool)
    is_invalid[invalid] = True
    order = np.random.default_rng(config.spec.seed).permutation(n_total)
    order = order[~is_invalid[order]]
    if order.size == 0:
        raise ValueError(f"{config.input}: no valid conversations")

    limit = LimitCounter(max_tokens=config.spec.max_conversation_tokens, too_long=config.spec.too_long)
    pieces = _sft_pieces(config, order, source, renderer, bundle.tokenizer, eos_id, forbidden, invalid, examples,
                         limit, reasons, images)
    with guarded_output_dir(config.out, **output_guard(config)) as staging:
        packed = pack_rows(config, pieces, staging, images)
        counts = record_counts(n_total, len(invalid), packed.doc_lengths, packed.used, packed.packer,
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


def _manifest(config: BuildJob, bundle: Any, renderer: ChatRenderer, eos: str, eos_id: int,
              template_source: str, source: Any, writer: RowsWriter, staging: Path,
              counts: dict[str, int], examples: list[str], limit: LimitCounter) -> dict[str, Any]:
    T = config.spec.row_tokens
    return {
        **rows_fields(config, writer),
        "packing": (f"source conversations in a seeded global permutation (numpy default_rng({config.spec.seed})"
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


def build_recipe_rows(spec: DataBuild, out: Path) -> Path:
    """Build a recipe's ``data.build`` rows into ``out`` unless a finished build is already there, and record (or
    check) what they were built from: rows another ``data.build`` made, or made from inputs changed since, are refused
    by the recipe key (``check_build_inputs``).

    Called once, before the training processes start, so the loop only ever reads rows.
    """
    try:
        if not (out / MANIFEST_FILE).is_file():
            build(spec, out, progress=False)
        check_build_inputs(spec, out)
    except (ValueError, FileNotFoundError) as error:  # named by the recipe's key, not data build's flag
        raise type(error)(_as_recipe_key(str(error))) from None
    return out


def _as_recipe_key(message: str) -> str:
    """A data build error that names a flag (``--tokenizer: ...``), naming the recipe key instead
    (``data.build.tokenizer: ...``): the flags are the keys (``config.recipe.data_build_flag``)."""
    for name in DataBuild.model_fields:
        flag = data_build_flag(name)
        if message.startswith(flag + ":") or message.startswith(flag + " "):
            return f"data.build.{name}" + message[len(flag):]
    return message
