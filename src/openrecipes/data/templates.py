"""Chat templates and loss-mask formats.

A conversation is rendered once with the tokenizer's Jinja chat template (the same sandboxed
Jinja settings Hugging Face tokenizers use). A loss-mask format names the text that opens an
assistant turn (the generation header) and the token that closes it; everything between, the
closing token included, is supervised: ``supervised_spans`` gives those character spans. The
whole rendered text is tokenized at once (see ``build``), so the token ids are exactly the
tokenizer's own for the conversation (``apply_chat_template(..., tokenize=True)``); a token is
supervised when any of its characters is, as transformers' assistant-token mask maps a span's
first and last characters to the tokens holding them. A token that merges the header's last
character with the content's first (``"\n"`` + ``"\n\nHi"`` can become one ``"\n\n\n"`` token) is
therefore supervised.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from openrecipes.config.recipe import RESERVED_TEMPLATE_KWARGS

from openrecipes.data import bundled
from openrecipes.data.template_sandbox import bounded_render

BUILTIN_TEMPLATES = bundled.TEMPLATES
# What each built-in template renders, relative to the model's own template; the manifest records it
# (docs/data.md, --chat-template). The qwen3 claim is tested in tests/data/test_qwen3_reference.py.
BUILTIN_TEMPLATE_NOTES = {
    "qwen3": ("renders the same text as the chat template of Qwen3-30B-A3B's tokenizer_config.json for every "
              "conversation that template renders (an empty <think> block opens the last assistant turn after the "
              "last user query; reasoning of turns up to that query is dropped); one difference: an unknown role "
              "is an error here, where Qwen3's template leaves the message out"),
    "muse_spark": "the project's own format: Muse Spark's template is not public",
}


@dataclass(frozen=True, kw_only=True)
class LossMaskFormat:
    """Where supervised text sits in a rendered conversation.

    ``header``: the generation header opening an assistant turn (never supervised).
    ``end``: the token closing the assistant turn (supervised).
    ``separator``: the default token appended after each conversation (never supervised).
    ``image``: the tokens the format's chat template writes for an image part (start, placeholder, end), the
    placeholder repeated once per merged patch of the image (as the model's processor expands it); None where the
    format has no image tokens (never supervised: data/image_rows.py).
    ``reply_markers``: the tokens the format gives meaning to inside an assistant's reply (reasoning and tool-call
    blocks): written there in a conversation's own ``content`` they keep their ids, as ``apply_chat_template`` passes
    them to the template and the tokenizer; anywhere else, and every other added token anywhere, is text
    (chat_input.Markers).
    """

    name: str
    header: str
    end: str
    separator: str
    image: tuple[str, str, str] | None = None
    reply_markers: tuple[str, ...] = ()

    def marker_tokens(self) -> list[str]:
        """Special tokens this format relies on; the tokenizer must know each as one token."""
        return sorted(set(re.findall(r"<\|[^|]+\|>", self.header + self.end + self.separator)))


QWEN_VL_IMAGE = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# Muse Spark's image tokens are not published: ours, in its Llama-style spelling (docs/muse_spark.md); <|image|> is the
# placeholder whose id the model's image_token_id names
MUSE_SPARK_IMAGE = ("<|image_start|>", "<|image|>", "<|image_end|>")
# what Qwen3's template and ours for Muse Spark give meaning to in a reply: reasoning and tool-call blocks (a turn's
# delimiters and a tool result's <tool_response> are never a reply's to write)
REASONING_AND_CALLS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
LOSS_MASKS: dict[str, LossMaskFormat] = {
    # Supervise assistant content and <|im_end|>; the "\n" after <|im_end|> belongs to the
    # unsupervised text that follows.
    # Qwen3-VL's template writes <|vision_start|><|image_pad|><|vision_end|> for an image part, its processor repeats
    # <|image_pad|> once per merged patch
    "qwen3": LossMaskFormat(name="qwen3", header="<|im_start|>assistant\n", end="<|im_end|>",
                            separator="<|endoftext|>", image=QWEN_VL_IMAGE, reply_markers=REASONING_AND_CALLS),
    # miles' qwen3 loss-mask generator: the same, and the "\n" after <|im_end|> supervised too
    "qwen3_miles": LossMaskFormat(name="qwen3_miles", header="<|im_start|>assistant\n", end="<|im_end|>\n",
                                  separator="<|endoftext|>", image=QWEN_VL_IMAGE, reply_markers=REASONING_AND_CALLS),
    # The project's own Muse Spark format (templates/muse_spark.jinja); an image part is <|image_start|>, <|image|>
    # once per merged patch, <|image_end|>
    "muse_spark": LossMaskFormat(name="muse_spark", header="<|header_start|>assistant<|header_end|>\n\n",
                                 end="<|eot|>", separator="<|end_of_text|>", image=MUSE_SPARK_IMAGE,
                                 reply_markers=REASONING_AND_CALLS),
}


def get_loss_mask(name: str) -> LossMaskFormat:
    if name not in LOSS_MASKS:
        raise ValueError(f"--loss-mask: unknown loss mask {name!r}; choose one of {', '.join(LOSS_MASKS)}")
    return LOSS_MASKS[name]


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    # Present for templates that call it; a build that relies on it is not reproducible,
    # so pass current_date explicitly instead.
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """Compile a chat template in a sandbox with the Hugging Face Jinja conventions, its work bounded
    (``template_sandbox``; render it with ``bounded_render``)."""
    from jinja2.ext import loopcontrols

    from openrecipes.data.template_sandbox import BoundedSandbox

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template line {error.lineno}: {error.message}") from None


@dataclass(frozen=True, kw_only=True)
class ChatRenderer:
    """Renders conversations with one template and splits them into masked pieces."""

    template: str
    loss_mask: LossMaskFormat
    special_tokens: dict[str, str | None]  # bos_token / eos_token as the template sees them
    template_kwargs: dict[str, Any]

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
        compiled = compile_template(self.template)
        try:
            return bounded_render(compiled, messages=messages, tools=tools, add_generation_prompt=False,
                                  **self.special_tokens, **self.template_kwargs)
        except jinja2.exceptions.SecurityError as error:  # the sandbox refused an attribute: never run it
            raise ValueError(f"chat template: {error}") from None
        except jinja2.TemplateError as error:  # an undefined field and the like: the data or the template
            raise ValueError(f"chat template: {type(error).__name__}: {error}") from None

    def supervised_spans(self, messages: list[dict[str, Any]],
                         tools: list[Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """Return the rendered text and its supervised character spans [start, stop), in order.

        Raises ValueError when the rendering does not contain one supervised span per
        assistant message: the template and the loss-mask format do not belong together.
        """
        text = self.render(messages, tools)
        header, end = self.loss_mask.header, self.loss_mask.end
        spans: list[tuple[int, int]] = []
        cursor = 0
        while True:
            start = text.find(header, cursor)
            if start < 0:
                break
            content_start = start + len(header)
            stop = text.find(end, content_start)
            if stop < 0:
                raise ValueError(f"rendered assistant turn has no closing {end!r} "
                                 f"(template does not fit the {self.loss_mask.name} loss mask)")
            if text.find(header, content_start, stop) >= 0:
                raise ValueError(f"rendered assistant turn is not closed by {end!r} before the next one")
            cursor = stop + len(end)
            spans.append((content_start, cursor))
        expected = sum(1 for m in messages if m.get("role") == "assistant")
        if len(spans) != expected:
            raise ValueError(f"the chat template rendered {len(spans)} assistant turn(s) in the "
                             f"{self.loss_mask.name} format ({header!r} ... {end!r}) for {expected} "
                             f"assistant message(s); the template does not fit --loss-mask {self.loss_mask.name}")
        return text, spans

    def pieces(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> tuple[list[str], list[int]]:
        """The rendered text cut at the edges of the supervised spans, and each piece's mask (0 or 1)."""
        text, spans = self.supervised_spans(messages, tools)
        pieces: list[str] = []
        masks: list[int] = []
        cursor = 0
        for start, stop in spans:
            pieces += [text[cursor:start], text[start:stop]]
            masks += [0, 1]
            cursor = stop
        pieces.append(text[cursor:])
        masks.append(0)
        keep = [i for i, piece in enumerate(pieces) if piece]
        return [pieces[i] for i in keep], [masks[i] for i in keep]


def token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token (character offsets [start, stop), shape (N, 2)) that overlaps a supervised span."""
    if not spans or len(offsets) == 0:
        return np.zeros(len(offsets), dtype=np.int8)
    span_starts = np.array([a for a, _ in spans], dtype=np.int64)
    span_stops = np.array([b for _, b in spans], dtype=np.int64)
    # the first span ending after the token's start overlaps it when it also begins before the token's end
    index = np.searchsorted(span_stops, offsets[:, 0], side="right")
    inside = index < len(spans)
    starts_before_end = span_starts[np.minimum(index, len(spans) - 1)] < np.maximum(offsets[:, 1], offsets[:, 0] + 1)
    return (inside & starts_before_end).astype(np.int8)


def builtin_template_note(text: str) -> str | None:
    """The note of the built-in template whose text is ``text`` (a copy such as the bundled tokenizer's counts)."""
    for name, path in BUILTIN_TEMPLATES.items():
        if path.read_text(encoding="utf-8") == text:
            return BUILTIN_TEMPLATE_NOTES[name]
    return None


def load_template_text(spec: str) -> tuple[str, str]:
    """Resolve ``--chat-template``: a built-in name or a file path. Returns (text, description)."""
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec].read_text(encoding="utf-8"), f"built-in {spec}"
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template: {spec} is neither a built-in template "
                                f"({', '.join(BUILTIN_TEMPLATES)}) nor a file")
    return path.read_text(encoding="utf-8"), str(path)


def parse_template_kwargs(items: list[str] | None) -> dict[str, Any]:
    """Parse ``k=v`` strings. ``true``/``false`` become booleans; everything else stays a string."""
    kwargs: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--template-kwargs: expected key=value, got {item!r}")
        key = key.strip()
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"--template-kwargs: {key!r} is set by the builder and cannot be overridden")
        lowered = value.strip().lower()
        kwargs[key] = True if lowered == "true" else False if lowered == "false" else value
    return kwargs
