"""Token-by-token masks on hand-written conversations, both formats.

The expected token stream is written out by hand as text pieces with their mask, tokenized
piece by piece: it does not go through the chat template, so it checks template and mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from openrecipes.data.tokenizer import BUNDLED_TOKENIZER

from tests.data.sft_data_helpers import read_rows, run_build, write_jsonl

TOK = Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json"))


def expected(pieces: list[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray]:
    ids: list[int] = []
    mask: list[int] = []
    for text, m in pieces:
        piece_ids = TOK.encode(text, add_special_tokens=False).ids
        ids += piece_ids
        mask += [m] * len(piece_ids)
    return np.array(ids), np.array(mask)


def build_one(tmp_path: Path, record: dict, pieces: list[tuple[str, int]], **overrides) -> None:
    """Build a single conversation into exactly one row and compare it token by token."""
    ids, mask = expected(pieces)
    src = write_jsonl(tmp_path / "one.jsonl", [record])
    run_build(tmp_path / "out", input=src, row_tokens=len(ids), **overrides)
    rows = read_rows(tmp_path / "out")
    assert rows["input_ids"].shape == (1, len(ids))
    np.testing.assert_array_equal(rows["input_ids"][0], ids)
    np.testing.assert_array_equal(rows["loss_mask"][0], mask)
    assert rows["doc_lens"] == [[len(ids)]]


def test_qwen3_multi_turn_with_system(tmp_path: Path) -> None:
    record = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Convert 3 hours to minutes."},
        {"role": "assistant", "content": "3 hours is 180 minutes."},
        {"role": "user", "content": "And 2 hours?"},
        {"role": "assistant", "content": "120 minutes."},
    ]}
    build_one(tmp_path, record, [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nConvert 3 hours to minutes.<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("3 hours is 180 minutes.<|im_end|>", 1),
        ("\n<|im_start|>user\nAnd 2 hours?<|im_end|>\n<|im_start|>assistant\n", 0),
        # Qwen3's template opens the last assistant turn after the last user query with a <think> block, empty here
        ("<think>\n\n</think>\n\n120 minutes.<|im_end|>", 1),
        ("\n<|endoftext|>", 0),
    ])


def test_qwen3_tool_turns_and_reasoning(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}
    record = {"messages": [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "It is 42.", "reasoning_content": "The tool said 42."},
    ], "metadata": {"tools": tools}}
    tools_json = json.dumps(tools[0], ensure_ascii=False)
    build_one(tmp_path, record, [
        ("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
         f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools_json}\n"
         "</tools>\n\nFor each function call, return a json object with function name and arguments within "
         "<tool_call></tool_call> XML tags:\n<tool_call>\n"
         '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
         "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n", 0),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call><|im_end|>', 1),
        ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nok\n</tool_response>"
         "<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nThe tool said 42.\n</think>\n\nIt is 42.<|im_end|>", 1),
        ("\n<|endoftext|>", 0),
    ])


def test_muse_spark_with_kwargs_and_tools(tmp_path: Path) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    record = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "content": "snowy"},
        {"role": "assistant", "content": "It is snowy."},
    ]}
    build_one(tmp_path, record, [
        ("<|begin_of_text|><|header_start|>system<|header_end|>\n\nCurrent date: 2026-10-01\n"
         "Reasoning effort: xhigh\n\nBe brief.<|eot|><|header_start|>user<|header_end|>\n\nWeather in Oslo?<|eot|>"
         "<|header_start|>assistant<|header_end|>\n\n", 0),
        ('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|eot|>', 1),
        ("<|header_start|>tool<|header_end|>\n\n<tool_response>snowy</tool_response><|eot|>"
         "<|header_start|>assistant<|header_end|>\n\n", 0),
        ("It is snowy.<|eot|>", 1),
        ("<|end_of_text|>", 0),
    ], loss_mask="muse_spark", chat_template="muse_spark",
        template_kwargs={"current_date": "2026-10-01", "reasoning_effort": "xhigh"})


def test_muse_spark_without_system_or_kwargs(tmp_path: Path) -> None:
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    build_one(tmp_path, record, [
        ("<|begin_of_text|><|header_start|>user<|header_end|>\n\nHi<|eot|>"
         "<|header_start|>assistant<|header_end|>\n\n", 0),
        ("Hello.<|eot|>", 1),
        ("<|end_of_text|>", 0),
    ], loss_mask="muse_spark", chat_template="muse_spark")


def test_template_from_tokenizer_config_field(tmp_path: Path) -> None:
    """A Hugging Face directory whose template lives only in tokenizer_config.json."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((BUNDLED_TOKENIZER / "tokenizer.json").read_bytes())
    config = json.loads((BUNDLED_TOKENIZER / "tokenizer_config.json").read_text())
    config["chat_template"] = (BUNDLED_TOKENIZER / "chat_template.jinja").read_text()
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    build_one(tmp_path, record, [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\n\n</think>\n\nHello.<|im_end|>", 1),
        ("\n<|endoftext|>", 0),
    ], tokenizer=tok_dir)


def test_template_that_does_not_fit_the_loss_mask(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="muse_spark"):
        run_build(tmp_path / "out", loss_mask="muse_spark")  # bundled template is the qwen3 one
    assert not (tmp_path / "out").exists()


def test_renders_like_transformers_apply_chat_template() -> None:
    """Our Jinja setup renders the bundled template exactly as transformers does."""
    transformers = pytest.importorskip("transformers")
    from openrecipes.data.templates import ChatRenderer, get_loss_mask
    from openrecipes.data.tokenizer import load_tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER))
    bundle = load_tokenizer(BUNDLED_TOKENIZER)
    renderer = ChatRenderer(template=bundle.chat_template, loss_mask=get_loss_mask("qwen3"),
                            special_tokens={"eos_token": bundle.config_token("eos_token")}, template_kwargs={})
    lines = (BUNDLED_TOKENIZER.parent / "conversations.jsonl").read_text().splitlines()[:60]
    for line in lines:
        record = json.loads(line)
        tools = record["metadata"].get("tools")
        assert hf.apply_chat_template(record["messages"], tools=tools, tokenize=False) == \
            renderer.render(record["messages"], tools)
