"""What real chat datasets hold, turned into the messages the chat template renders, by explicit options.

* ``messages_field``: the column or key holding the conversation (default ``messages``; ``conversations`` for
  ShareGPT).
* ``shape``: ``openai`` (``role``/``content`` messages) or ``sharegpt`` (``from``/``value`` turns: human, gpt,
  system, function_call, observation, tool).
* ``role_map``: roles renamed before the check, e.g. ``developer=system,function=tool,ipython=tool``.
* OpenAI-style content parts (a list of ``{"type": "text", "text": ...}``) are joined into one string; with
  ``images`` an image part (``{"type": "image", "image": "local/path.png"}``) becomes a numbered marker in that string
  and its path goes to the message's ``images`` list (data/image_rows.py expands the marker into the chat format's
  image tokens); any other part (audio, a file, an image without ``images``) is refused by its type.
* ``special_tokens``: an added token of the tokenizer, special or not (``<|im_end|>``, and Qwen3's ``<think>``,
  ``<tool_call>``, ``<tool_response>``, which it does not mark special), inside the conversation's own strings is
  tokenized as text, as a template tokenizer with ``split_special_tokens`` does (``text``, the default), or the
  conversation is refused (``refuse``): it can never close a turn nor forge a tool's result, and in a user, system
  or tool turn never forge reasoning or a tool call. One exception (``Markers``): in an assistant's ``content`` the
  markers the chat format gives meaning to in a reply (the loss-mask format's ``reply_markers``: Qwen3's
  ``<think>…</think>`` and ``<tool_call>…</tool_call>``) reach the template and the tokenizer as
  ``apply_chat_template`` passes them, so inline reasoning is split off and tokenized as transformers does;
  ``text_everywhere`` makes those text too.

Every option is written into the manifest (``chat_input``), so a build says how it read its conversations.
"""

from __future__ import annotations

import json
import re
from array import array
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterator, get_args

import numpy as np

from openrecipes.config.recipe import ChatInputShape, ChatRole, SpecialTokensInText
from openrecipes.data import stream
from openrecipes.data.stream import encode_windows

ROLES = get_args(ChatRole)
SHAPES = get_args(ChatInputShape)
SPECIAL_TOKEN_POLICIES = get_args(SpecialTokensInText)
# ShareGPT speakers and the roles they are (LLaMA-Factory's and FastChat's spellings)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
# content parts whose text is kept; any other type is refused by name
TEXT_PART = "text"
IMAGES_KEY = "images"  # a shaped message's image paths, in the order of its markers
# An added token found in a conversation's strings is swapped for this marker while the template renders (so it
# cannot open or close a turn there) and put back before tokenizing: two noncharacters around the token's number.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
# An image part stands in its message's content as these noncharacters around the image's number until the rendered
# text is expanded into the chat format's image tokens (image_rows.py)
IMAGE_PART = "image"
_IMAGE_OPEN, _IMAGE_CLOSE = "\ufdd2", "\ufdd3"
IMAGE_MARKER = re.compile(f"{_IMAGE_OPEN}(\\d+){_IMAGE_CLOSE}")


@dataclass(frozen=True)
class Markers:
    """The tokenizer's added tokens that a conversation's own strings may not carry as tokens: ``anywhere`` every one
    of them; ``in_replies`` those an assistant's ``content`` may not (all but the format's ``reply_markers``, or all
    under ``text_everywhere``; None: none)."""

    anywhere: re.Pattern[str]
    in_replies: re.Pattern[str] | None

    @classmethod
    def of(cls, bundle: Any, loss_mask: Any, policy: str) -> "Markers | None":
        """For ``bundle``'s tokenizer under ``loss_mask``'s format and the ``special_tokens`` policy; None when the
        tokenizer has no added token."""
        anywhere = bundle.marker_pattern()
        if anywhere is None:
            return None
        keep = () if policy == "text_everywhere" else loss_mask.reply_markers
        return cls(anywhere=anywhere, in_replies=bundle.marker_pattern(keep))

    def for_field(self, role: Any, key: str) -> re.Pattern[str] | None:
        """What the field ``key`` of a message of ``role`` may not carry as a token (None: anything; the role
        itself is one of ROLES)."""
        if key == "role":
            return None
        return self.in_replies if role == "assistant" and key == "content" else self.anywhere


class InvalidConversation(ValueError):
    """A conversation the chat template cannot render into a supervised document; ``reason`` names the kind, for
    the counts of a build that skips them."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class ChatInput:
    shape: str = "openai"
    messages_field: str | None = None  # None: "messages", or "conversations" for sharegpt
    role_map: dict[str, str] = field(default_factory=dict)
    special_tokens: str = "text"
    images: bool = False  # image parts are read (the build then needs an image processor: data/image_rows.py)

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"--input-shape: expected one of {', '.join(SHAPES)}, got {self.shape!r}")
        if self.special_tokens not in SPECIAL_TOKEN_POLICIES:
            raise ValueError(f"--special-tokens-in-text: expected one of {', '.join(SPECIAL_TOKEN_POLICIES)}, got "
                             f"{self.special_tokens!r}")
        for old, new in self.role_map.items():
            if new not in ROLES:
                raise ValueError(f"--role-map: {old}={new}: a role maps to one of {', '.join(ROLES)}")

    @property
    def column(self) -> str:
        return self.messages_field or ("conversations" if self.shape == "sharegpt" else "messages")

    def to_manifest(self) -> dict[str, Any]:
        parts = ("text parts joined with no separator; image parts read as images; other parts refused" if self.images
                 else "text parts joined with no separator; other parts refused")
        return {"shape": self.shape, "messages_field": self.column, "role_map": dict(self.role_map),
                "content_parts": parts,
                "special_tokens_in_text": self.special_tokens}


def parse_role_map(text: str | None) -> dict[str, str]:
    """``"developer=system,function=tool"`` -> {"developer": "system", "function": "tool"}."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise ValueError(f"--role-map: expected FROM=TO pairs separated by commas, got {item.strip()!r}")
        out[old.strip()] = new.strip()
    return out


def _join_parts(content: list[Any], where: str, images: list[str] | None = None) -> str:
    """The text parts joined; with ``images`` (a list to fill) each image part becomes ``image_marker(k)`` and its
    path is appended to ``images``."""
    texts = []
    for number, part in enumerate(content, start=1):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if images is not None and kind == IMAGE_PART:
            texts.append(image_marker(len(images)))
            images.append(image_path(part.get(IMAGE_PART), f"{where}: content part {number}"))
            continue
        if kind == TEXT_PART and not isinstance(part.get("text"), str):
            raise InvalidConversation(f"{where}: content part {number} is a text part without a string 'text'",
                                      "text part without text")
        if kind != TEXT_PART:
            raise InvalidConversation(f"{where}: content part {number} is {kind!r}; only text parts are read"
                                      + (" and image parts" if images is not None else
                                         " (image parts with an image processor: --image-processor)"),
                                      "non-text content part")
        if images is not None and (_IMAGE_OPEN in part["text"] or _IMAGE_CLOSE in part["text"]):
            raise InvalidConversation(f"{where}: content part {number} holds the noncharacters U+FDD2/U+FDD3, "
                                      "which mark images while rendering", "marker characters")
        texts.append(part["text"])
    return "".join(texts)


def image_marker(number: int) -> str:
    """What stands for image ``number`` of a message in its content while the template renders."""
    return f"{_IMAGE_OPEN}{number}{_IMAGE_CLOSE}"


def image_path(value: Any, where: str) -> str:
    """An image part's local file path; a URL (or anything but a path string) is refused."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidConversation(f"{where}: an image part's 'image' must be a local file path", "bad image")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:(//|[^\\/])", value):  # http://, file://, data:... (not C:\)
        raise InvalidConversation(f"{where}: image {value[:80]!r} is a URL; only local files are read (download "
                                  "it first)", "bad image")
    return value


def _sharegpt_message(raw: dict[str, Any], where: str) -> dict[str, Any]:
    speaker, value = raw.get("from"), raw.get("value")
    role = SHAREGPT_ROLES.get(speaker, speaker) if isinstance(speaker, str) else speaker  # a list: refused later
    if speaker == "function_call":  # the value is the call: {"name": ..., "arguments": ...}
        try:
            call = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise InvalidConversation(f"{where}: a function_call turn's value must be a JSON object with a 'name'",
                                      "bad field")
        return {"role": role, "content": "", "tool_calls": [{"type": "function", "function": call}]}
    extra = {k: v for k, v in raw.items() if k not in ("from", "value")}
    return {**extra, "role": role, "content": value}


def shape_message(raw: Any, options: ChatInput, where: str) -> Any:
    """One message as the template expects it (role, content as a string), before the checks of ``normalize``."""
    if not isinstance(raw, dict):
        return raw
    message = _sharegpt_message(raw, where) if options.shape == "sharegpt" else dict(raw)
    role = message.get("role")
    if isinstance(role, str) and role in options.role_map:
        message["role"] = options.role_map[role]
    if isinstance(message.get("content"), list):
        images: list[str] | None = [] if options.images else None
        message["content"] = _join_parts(message["content"], where, images)
        if images:
            message[IMAGES_KEY] = images
    return message


# Rebuilt texts are joined every this many pieces: a substitution over a long text would otherwise hold a Python
# string per quoted token until its end (about a hundred bytes each, more than the text itself)
_JOIN_PIECES = 4096


@dataclass(frozen=True)
class Shielded:
    """Special tokens found in a conversation's strings (each distinct token once), replaced by numbered markers
    while the template renders."""

    tokens: list[str]

    def restore(self, text: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]], np.ndarray]:
        """The rendered ``text`` with its tokens back, its supervised ``spans`` moved to match, and where each token
        now stands (character spans that are text, not added tokens: an (N, 2) int64 array, 16 bytes a token)."""
        points = [p for span in spans for p in span]
        order = sorted(range(len(points)), key=points.__getitem__)
        moved = list(points)
        forged = array("q")
        shift = done = 0

        def swap(match: re.Match[str]) -> str:
            nonlocal shift, done
            while done < len(order) and points[order[done]] < match.end():  # before this marker: the shift so far
                moved[order[done]] += shift
                done += 1
            token = self.tokens[int(match.group(1))]
            start = match.start() + shift
            forged.extend((start, start + len(token)))
            shift += len(token) - (match.end() - match.start())
            return token

        restored = _substitute(_MARKER, swap, text)
        for k in order[done:]:
            moved[k] += shift
        return restored, list(zip(moved[0::2], moved[1::2])), np.frombuffer(forged, dtype=np.int64).reshape(-1, 2)


def shield(value: Any, pattern: re.Pattern[str], found: list[str]) -> Any:
    """``value`` with every added token in its strings (keys included) replaced by a marker numbering the token in
    ``found``, where each distinct token is appended once (recursive: the JSON reader has already bounded the
    nesting)."""
    if isinstance(value, str):
        def swap(match: re.Match[str]) -> str:
            token = match.group(0)
            if token not in found:
                found.append(token)
            return f"{_OPEN}{found.index(token)}{_CLOSE}"
        return _substitute(pattern, swap, value)
    if isinstance(value, dict):
        return {shield(k, pattern, found): shield(v, pattern, found) for k, v in value.items()}
    if isinstance(value, list):
        return [shield(v, pattern, found) for v in value]
    return value


def shield_conversation(messages: list[dict[str, Any]], tools: Any, markers: Markers,
                        found: list[str]) -> tuple[list[dict[str, Any]], Any]:
    """``shield`` of each message's fields with what its role may not carry (``Markers.for_field``), and of the
    tools with every added token."""
    def field(role: Any, key: str, value: Any) -> Any:
        pattern = markers.for_field(role, key)
        return value if pattern is None else shield(value, pattern, found)

    shielded = [{key: field(message.get("role"), key, value) for key, value in message.items()} for message in messages]
    return shielded, shield(tools, markers.anywhere, found)


def _substitute(pattern: re.Pattern[str], swap: Any, text: str) -> str:
    """``pattern.sub(swap, text)``, joining its pieces as it goes (``_JOIN_PIECES``)."""
    chunks: list[str] = []
    pieces: list[str] = []
    cursor = 0
    for match in pattern.finditer(text):
        pieces += (text[cursor:match.start()], swap(match))
        cursor = match.end()
        if len(pieces) >= _JOIN_PIECES:
            chunks.append("".join(pieces))
            pieces.clear()
    chunks.append("".join([*pieces, text[cursor:]]))
    return "".join(chunks)


def has_marker_characters(value: Any) -> bool:
    """Whether the conversation itself holds the marker's noncharacters (then it cannot be shielded)."""
    text = json.dumps(value, ensure_ascii=False)
    return _OPEN in text or _CLOSE in text


class _AsText:
    """A tokenizer whose ``encode`` reads every added token as text (``split_special_tokens``) for that call alone,
    so a windowed encoding left unfinished (a conversation over its token limit) never leaves it set."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        previous = self.tokenizer.encode_special_tokens
        self.tokenizer.encode_special_tokens = True
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        finally:
            self.tokenizer.encode_special_tokens = previous


def text_token_windows(tokenizer: Any, text: str, forged: Any,
                       pattern: re.Pattern[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Token ids and character offsets of ``text``, a bounded stretch at a time: the template's added tokens as
    themselves, the text between them (the ``forged`` tokens in it included) tokenized as text, as
    ``split_special_tokens`` does, a long stretch window by window (stream.encode_windows).

    The tokenizer itself cuts its input at added tokens and encodes the pieces between apart; this cuts at the
    template's tokens only, so a conversation without ``forged`` tokens gets exactly the ids of one encode."""
    inside = np.asarray(forged, dtype=np.int64).reshape(-1, 2)[:, 0]  # in order, as the tokens stand in the text
    held: list[tuple[np.ndarray, np.ndarray]] = []
    held_from = 0
    for ids, offsets in _stretches(tokenizer, text, inside, pattern):
        held.append((ids, offsets))
        # stretches are held until they span a window's characters, so a conversation of many turns is few pieces
        if offsets.size and offsets[-1, 1] - held_from >= stream.WINDOW_CHARS:
            yield np.concatenate([ids for ids, _ in held]), np.concatenate([offsets for _, offsets in held])
            held, held_from = [], int(offsets[-1, 1])
    if held:
        yield np.concatenate([ids for ids, _ in held]), np.concatenate([offsets for _, offsets in held])


def _stretches(tokenizer: Any, text: str, inside: np.ndarray,
               pattern: re.Pattern[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each template token of ``text`` alone, and the text between two of them window by window, as text."""
    as_text = _AsText(tokenizer)
    cursor = 0
    for match in chain(_template_tokens(pattern, text, inside), [None]):
        stop = match.start() if match else len(text)
        if stop > cursor:
            for ids, offsets in encode_windows(as_text, text[cursor:stop]):
                yield ids, offsets + cursor
        if match:
            yield (np.array([tokenizer.token_to_id(match.group(0))], dtype=np.int32),
                   np.array([[match.start(), match.end()]], dtype=np.int64))
            cursor = match.end()


def _template_tokens(pattern: re.Pattern[str], text: str, inside: np.ndarray) -> Iterator[re.Match[str]]:
    """The matches of ``pattern`` in ``text`` that do not start at a quoted token (``inside``: their starts)."""
    skipped = 0
    for match in pattern.finditer(text):
        while skipped < inside.size and inside[skipped] < match.start():
            skipped += 1
        if skipped == inside.size or inside[skipped] != match.start():
            yield match


def encode_with_text_tokens(tokenizer: Any, text: str, forged: Any,
                            pattern: re.Pattern[str]) -> tuple[np.ndarray, np.ndarray]:
    """``text_token_windows`` of a text short enough to hold its encoding whole: (ids, (N, 2) offsets)."""
    windows = list(text_token_windows(tokenizer, text, forged, pattern))
    if not windows:
        return np.zeros(0, dtype=np.int32), np.zeros((0, 2), dtype=np.int64)
    return np.concatenate([ids for ids, _ in windows]), np.concatenate([offsets for _, offsets in windows])


def count_skipped(reasons: dict[str, dict[str, Any]], error: Exception, where: str, first: int = 3) -> None:
    """Count a skipped conversation under its reason, keeping where the ``first`` few of each reason are."""
    reason = error.reason if isinstance(error, InvalidConversation) else "template error"
    entry = reasons.setdefault(reason, {"count": 0, "first": []})
    entry["count"] += 1
    if len(entry["first"]) < first:
        entry["first"].append(where)
