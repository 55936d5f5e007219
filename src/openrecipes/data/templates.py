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
from openrecipes.data.tokenizer import read_utf8
from openrecipes.utils import one_line

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
    ``end``: the token closing the assistant turn (supervised); ``also_ends``: other tokens that close one (harmony's
    ``<|return|>`` and ``<|call|>``; GLM's next-turn roles, which its model emits to stop).
    ``open_end``: a turn without a closing token ends before the next header, or at the end of the text, where the
    separator appended after the conversation is what the model emits to stop: it is then supervised.
    ``joins``: a header right after a closing token continues the same reply (harmony's analysis message followed by
    its final or tool-call message: the model writes that header itself), so it is supervised as part of the reply.
    ``separator``: the default token appended after each conversation (supervised only as ``open_end`` says).
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
    also_ends: tuple[str, ...] = ()
    open_end: bool = False
    joins: bool = False
    image: tuple[str, str, str] | None = None
    reply_markers: tuple[str, ...] = ()

    @property
    def ends(self) -> tuple[str, ...]:
        return (self.end, *self.also_ends)

    def marker_tokens(self) -> list[str]:
        """Special tokens this format relies on; the tokenizer must know each as one token."""
        return sorted(set(re.findall(r"<\|[^|]+\|>", self.header + "".join(self.ends) + self.separator)))


QWEN_VL_IMAGE = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# Muse Spark's image tokens are not published: ours, in its Llama-style spelling (docs/muse_spark.md); <|image|> is the
# placeholder whose id the model's image_token_id names
MUSE_SPARK_IMAGE = ("<|image_start|>", "<|image|>", "<|image_end|>")
# what Qwen3's template and ours for Muse Spark give meaning to in a reply: reasoning and tool-call blocks (a turn's
# delimiters and a tool result's <tool_response> are never a reply's to write)
REASONING_AND_CALLS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# GLM-4.5's template splits inline reasoning as Qwen3's does, and its tool calls hold their arguments in these blocks
GLM_REPLY_MARKERS = (*REASONING_AND_CALLS, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
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
    # gpt-oss's harmony format: every assistant message (analysis, final, tool call) opens with <|start|>assistant and
    # is closed by <|end|>, by <|return|> (the last final message of a training render) or <|call|> (a tool call);
    # messages of one reply follow each other directly and are supervised as one span, their inner headers included.
    # No added token keeps its id in a reply's content: the template puts reasoning in `thinking` itself, and a
    # channel token there would forge a message
    "gpt_oss": LossMaskFormat(name="gpt_oss", header="<|start|>assistant", end="<|end|>",
                              also_ends=("<|return|>", "<|call|>"), joins=True, separator="<|endoftext|>"),
    # GLM-4.5: no token of its own closes a reply; the model stops by emitting the next turn's <|user|> or
    # <|observation|> (its generation config's stop tokens), supervised, or <|endoftext|> after the last turn
    "glm4": LossMaskFormat(name="glm4", header="<|assistant|>", end="<|user|>", also_ends=("<|observation|>",),
                           open_end=True, separator="<|endoftext|>", reply_markers=GLM_REPLY_MARKERS),
}


def get_loss_mask(name: str) -> LossMaskFormat:
    if name not in LOSS_MASKS:
        raise ValueError(f"--loss-mask: unknown loss mask {name!r}; choose one of {', '.join(LOSS_MASKS)}")
    return LOSS_MASKS[name]


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {one_line(message)}")


# The template kwarg that fixes what strftime_now() renders, recorded with the others in the manifest
STRFTIME_NOW = "strftime_now"


def _unset_strftime_now(fmt: str) -> str:
    raise ValueError(f"chat template: it calls {STRFTIME_NOW}(), so its text would change with the day of the build; "
                     f"give the date it renders: --template-kwargs {STRFTIME_NOW}=YYYY-MM-DD (in a recipe, "
                     f"data.build.template_kwargs.{STRFTIME_NOW})")


def fixed_strftime_now(date: Any) -> Any:
    """``strftime_now`` as the template sees it: ``date`` (ISO 8601) formatted, never the clock, so that a rebuild
    renders the same text; without a date a template calling it is refused."""
    if date is None:
        return _unset_strftime_now
    try:
        moment = datetime.fromisoformat(str(date))
    except ValueError:
        raise ValueError(f"--template-kwargs {STRFTIME_NOW}={date}: not an ISO 8601 date (YYYY-MM-DD or "
                         "YYYY-MM-DDTHH:MM:SS)") from None
    return lambda fmt: moment.strftime(fmt)


class _Dict:
    """``dict`` as transformers gives it to templates: the constructor and ``fromkeys``, nothing of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() without attributes that start with ``_``, as transformers' (no road to CPython's dunders)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


@lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """Compile a chat template in a sandbox with the globals and filters transformers gives templates
    (``raise_exception``, ``strftime_now``, ``tojson``, ``dict``, ``namespace``, loop controls), its work bounded
    (``template_sandbox``; render it with ``bounded_render``)."""
    from jinja2.ext import loopcontrols

    from openrecipes.data.template_sandbox import BoundedSandbox

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals[STRFTIME_NOW] = _unset_strftime_now  # each render passes its own (ChatRenderer.render)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template line {error.lineno}: {error.message}") from None


# What a template's own filters and operators raise on data they cannot handle: Jinja's `items` filter on a string,
# `+` of a string and a list, an index past the end. They belong to the conversation, as a template error does, so
# each is one line naming the conversation (or a skipped one under --skip-invalid), never a traceback.
TEMPLATE_DATA_ERRORS = (TypeError, LookupError, ArithmeticError, AttributeError)


def string_arguments_hint(messages: list[dict[str, Any]]) -> str:
    """A note naming the first message whose tool call gives its arguments as a JSON string, or "".

    OpenAI's messages carry them so; apply_chat_template passes them to the template as they are, and the templates
    that write each argument (GLM's <arg_key> blocks, Qwen3.5's <parameter=...>) iterate them as an object and fail
    on a string, so the error says which construct it was."""
    for position, message in enumerate(messages, start=1):
        for call in message.get("tool_calls") or ():
            function = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                return (f" (message {position} gives a tool call's arguments as a JSON string, which this template "
                        "may need as an object; apply_chat_template passes them unparsed too)")
    return ""


# The named special tokens transformers passes to a template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
TEMPLATE_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# a message's reasoning under the names datasets use; templates read reasoning_content, gpt-oss's `thinking`
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its reasoning under both names templates read, as ``apply_chat_template`` passes it."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


@dataclass(frozen=True, kw_only=True)
class ChatRenderer:
    """Renders conversations with one template and splits them into masked pieces."""

    template: str
    loss_mask: LossMaskFormat
    special_tokens: dict[str, str | None]  # TEMPLATE_SPECIAL_TOKENS as the template sees them
    template_kwargs: dict[str, Any]  # STRFTIME_NOW among them: the date strftime_now() renders, not a variable

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
        compiled = compile_template(self.template)
        variables = {**self.special_tokens, **self.template_kwargs}
        variables[STRFTIME_NOW] = fixed_strftime_now(variables.get(STRFTIME_NOW))
        try:
            return bounded_render(compiled, messages=[alias_reasoning(m) for m in messages], tools=tools,
                                  documents=None, add_generation_prompt=False, **variables)
        except jinja2.exceptions.SecurityError as error:  # the sandbox refused an attribute: never run it
            raise ValueError(f"chat template: {error}") from None
        except (jinja2.TemplateError, *TEMPLATE_DATA_ERRORS) as error:  # an undefined field and the like
            raise ValueError(f"chat template: {type(error).__name__}: {error}{string_arguments_hint(messages)}"
                             ) from None

    def supervised_spans(self, messages: list[dict[str, Any]],
                         tools: list[Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """Return the rendered text and its supervised character spans [start, stop), in order; a span that stops
        at ``len(text) + 1`` supervises the separator after the conversation too (``open_end``).

        Raises ValueError when the rendering does not contain one supervised span per
        assistant message: the template and the loss-mask format do not belong together.
        """
        text = self.render(messages, tools)
        spans, turns = turn_spans(text, self.loss_mask)
        fmt = self.loss_mask
        expected = sum(1 for m in messages if m.get("role") == "assistant")
        fits = len(spans) <= expected <= turns if fmt.joins else len(spans) == expected
        if not fits:
            raise ValueError(f"the chat template rendered {turns} assistant turn(s) in the "
                             f"{fmt.name} format ({fmt.header!r} ... {' or '.join(map(repr, fmt.ends))}) for "
                             f"{expected} assistant message(s); the template does not fit --loss-mask {fmt.name}")
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


def turn_spans(text: str, fmt: LossMaskFormat) -> tuple[list[tuple[int, int]], int]:
    """The supervised spans of ``text`` in ``fmt`` and the number of assistant turns (headers) found."""
    header = fmt.header
    closer = re.compile("|".join(re.escape(end) for end in fmt.ends))
    spans: list[tuple[int, int]] = []
    turns = cursor = 0
    while (start := text.find(header, cursor)) >= 0:
        turns += 1
        content_start = start + len(header)
        next_header = text.find(header, content_start)
        limit = len(text) if next_header < 0 else next_header
        if close := closer.search(text, content_start, limit):
            stop = close.end()
        elif fmt.open_end:  # ends where the next turn begins, or with the separator after the text
            stop = len(text) + 1 if next_header < 0 else next_header
        elif next_header >= 0:
            raise ValueError(f"rendered assistant turn is not closed by {fmt.end!r} before the next one")
        else:
            raise ValueError(f"rendered assistant turn has no closing {fmt.end!r} "
                             f"(template does not fit the {fmt.name} loss mask)")
        if fmt.joins and spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], stop)
        else:
            spans.append((content_start, stop))
        cursor = stop
    return spans, turns


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
    return read_utf8(path), str(path)


def parse_template_kwargs(items: list[str] | None) -> dict[str, Any]:
    """Parse ``k=v`` strings. ``true``/``false`` become booleans, a JSON list of strings (``["browser"]``) a list;
    everything else stays a string."""
    kwargs: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--template-kwargs: expected key=value, got {item!r}")
        key = key.strip()
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"--template-kwargs: {key!r} is set by the builder and cannot be overridden")
        lowered = value.strip().lower()
        if value.strip().startswith("["):
            kwargs[key] = _string_list(key, value)
            continue
        kwargs[key] = True if lowered == "true" else False if lowered == "false" else value
    return kwargs


def _string_list(key: str, value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise ValueError(f"--template-kwargs: {key}: a value starting with '[' must be a JSON list of strings, such "
                         f"as [\"browser\", \"python\"]; got {value[:80]!r}")
    return parsed
