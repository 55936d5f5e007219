"""Bounded-memory tokenization for ``data build`` (docs/data.md, "Memory").

The builder never holds more than one batch of rendered conversations (at most ``chunk_conversations`` of them
or ``BATCH_CHARS`` characters) and never asks the tokenizer for more than ``WINDOW_CHARS`` characters at once:
a tokenizer's ``Encoding`` costs about a hundred bytes per token on each side of the Python boundary, so one 50 MB
conversation encoded whole took gigabytes. A conversation longer than a window is encoded window by window and
handed to the packer piece by piece; a shorter one is encoded whole, exactly as before, so the rows of ordinary
input do not change.

Stitching windows: a window ``[pos, end)`` is encoded, and so is a short look-ahead ``[end - 2M, end + M)``. The
cut ``c`` is the last token boundary within ``[end - 1.5M, end - 0.5M]`` that both encodings have: there the
tokens on the left were seen with ``W`` characters of left context and those on the right with ``M`` characters
of right context, and both agree that no token crosses ``c``. Tokens before ``c`` are emitted; the next window
starts at ``c``. Where the two never agree (one enormous word without a boundary in ``M`` characters), the cut
falls on the window's own last boundary in that range, which may differ from a whole-text encoding there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, get_args

import numpy as np

from openrecipes.config.recipe import TooLong
from openrecipes.data.templates import token_mask

WINDOW_CHARS = 1 << 16  # characters per tokenizer call for a long text (read at each call)
MARGIN_CHARS = 1 << 10  # the look-ahead's context on each side of a window's cut
BATCH_CHARS = 1 << 20  # rendered characters per encode_batch call of ordinary conversations
TOO_LONG = get_args(TooLong)


@dataclass(frozen=True, kw_only=True)
class Piece:
    """A stretch of the token stream handed to the packer.

    ``lengths``: the tokens of each document part in the piece, in order (they sum to ``ids.size``);
    ``continues``: the first part continues the previous piece's last document (a long conversation's windows).
    """

    ids: np.ndarray  # int32
    mask: np.ndarray  # int8
    lengths: np.ndarray  # int64
    continues: bool = False
    images: np.ndarray | None = None  # int64 per token: which image token it is (image_rows.py), -1 for text


def _encode(tokenizer: Any, text: str, base: int) -> tuple[np.ndarray, np.ndarray]:
    encoding = tokenizer.encode(text, add_special_tokens=False)
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2) + base
    return np.asarray(encoding.ids, dtype=np.int32), offsets


def _boundaries(offsets: np.ndarray) -> np.ndarray:
    """Character positions where one token ends and the next begins (not inside a character split into bytes)."""
    starts, ends = offsets[1:, 0], offsets[:-1, 1]
    return starts[(ends <= starts) & (starts > offsets[:-1, 0])]


def is_long(text: str) -> bool:
    """Whether ``text`` is encoded in windows rather than whole."""
    return len(text) > WINDOW_CHARS


def encode_windows(tokenizer: Any, text: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (ids, character offsets into ``text``) of ``text``'s tokenization, one window at a time."""
    window, margin = WINDOW_CHARS, MARGIN_CHARS
    pos, n = 0, len(text)
    while pos < n:
        end = pos + window
        if end >= n:
            yield _encode(tokenizer, text[pos:], pos)
            return
        ids, offsets = _encode(tokenizer, text[pos:end], pos)
        ahead = end - 2 * margin
        _, ahead_offsets = _encode(tokenizer, text[ahead:min(end + margin, n)], ahead)
        own = _boundaries(offsets)
        lo, hi = end - 3 * margin // 2, end - margin // 2
        agreed = np.intersect1d(own, _boundaries(ahead_offsets))
        agreed = agreed[(agreed >= lo) & (agreed <= hi)]
        if agreed.size:
            cut = int(agreed[-1])
        else:  # no boundary both agree on: the window's own last one in range (or before it)
            candidates = own[(own > pos) & (own <= hi)]
            cut = int(candidates[-1]) if candidates.size else end
        keep = offsets[:, 0] < cut
        yield ids[keep], offsets[keep]
        pos = cut


@dataclass(kw_only=True)
class LimitCounter:
    """The per-conversation token limit and how many conversations it caught."""

    max_tokens: int | None
    too_long: str = "skip"
    over_limit: int = 0

    def manifest_field(self) -> dict[str, Any] | None:
        return None if self.max_tokens is None else {"max_tokens": self.max_tokens, "too_long": self.too_long}


def conversation_parts(ids: np.ndarray, offsets: np.ndarray, supervised: list[tuple[int, int]], eos_id: int,
                        limit: LimitCounter) -> tuple[np.ndarray, np.ndarray] | None:
    """One encoded conversation's ids and mask followed by the separator, or None when the limit skips it."""
    stops = separator_supervised(offsets, supervised)
    if limit.max_tokens is not None and ids.size > limit.max_tokens:
        limit.over_limit += 1
        if limit.too_long == "skip":
            return None
        ids, offsets = ids[:limit.max_tokens], offsets[:limit.max_tokens]
        stops = False  # a cut reply does not end there
    return (np.concatenate([ids, np.array([eos_id], dtype=np.int32)]),
            np.concatenate([token_mask(offsets, supervised), np.array([stops], dtype=np.int8)]))


def separator_supervised(offsets: np.ndarray, supervised: list[tuple[int, int]]) -> bool:
    """Whether the separator after the conversation is supervised: its last span runs past the text, as a reply that
    no token of its own closes does when the conversation ends with it (LossMaskFormat.open_end)."""
    end = int(offsets[-1, 1]) if len(offsets) else 0
    return bool(supervised) and supervised[-1][1] > end


def _piece(parts: list[tuple[np.ndarray, np.ndarray]]) -> Iterator[Piece]:
    if parts:
        yield Piece(ids=np.concatenate([ids for ids, _ in parts]), mask=np.concatenate([mask for _, mask in parts]),
                    lengths=np.asarray([ids.size for ids, _ in parts], dtype=np.int64))


def batch_piece(texts: list[str], spans: list[list[tuple[int, int]]], tokenizer: Any, eos_id: int,
                limit: LimitCounter) -> Iterator[Piece]:
    """One piece of whole conversations, each followed by the separator."""
    # the whole rendered conversation at once: its ids are the tokenizer's own for that text
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    parts = [conversation_parts(np.asarray(encoding.ids, dtype=np.int32),
                                 np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2), supervised, eos_id, limit)
             for encoding, supervised in zip(encodings, spans)]
    yield from _piece([part for part in parts if part is not None])


def encoded_piece(ids: Any, offsets: Any, supervised: list[tuple[int, int]], eos_id: int,
                  limit: LimitCounter) -> Iterator[Piece]:
    """One conversation already encoded (ids and character offsets), as a piece."""
    part = conversation_parts(np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64).reshape(-1, 2),
                               supervised, eos_id, limit)
    yield from _piece([part] if part is not None else [])


def long_pieces(windows: Iterable[tuple[np.ndarray, np.ndarray]], spans: list[tuple[int, int]], eos_id: int,
                limit: LimitCounter) -> Iterator[Piece]:
    """One conversation longer than a window, encoded a window at a time (``windows``: ids and character offsets,
    e.g. ``encode_windows``), as consecutive pieces of one document ending with the separator.

    Under a limit with ``skip``, the windows are held until the conversation is known to fit (at most
    ``max_tokens`` tokens); otherwise each window goes to the packer as soon as it is encoded."""
    cap = limit.max_tokens
    hold = cap is not None and limit.too_long == "skip"
    held: list[tuple[np.ndarray, np.ndarray]] = []
    count = 0
    started = stops = False
    for ids, offsets in windows:
        mask = token_mask(offsets, spans)
        stops = separator_supervised(offsets, spans) if len(offsets) else stops
        over = cap is not None and count + ids.size > cap
        if over:
            stops = False
            limit.over_limit += 1
            if hold:
                return
            ids, mask = ids[:cap - count], mask[:cap - count]
        count += ids.size
        if hold:
            held.append((ids, mask))
        elif ids.size:
            yield Piece(ids=ids, mask=mask, lengths=np.array([ids.size]), continues=started)
            started = True
        if over:
            break
    if held:
        ids, mask = np.concatenate([h[0] for h in held]), np.concatenate([h[1] for h in held])
        yield Piece(ids=ids, mask=mask, lengths=np.array([ids.size]))
        started = True
    yield Piece(ids=np.array([eos_id], dtype=np.int32), mask=np.array([stops], dtype=np.int8), lengths=np.array([1]),
                continues=started)
