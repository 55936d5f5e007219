"""Real chat data: ShareGPT turns, role maps, content parts, a messages field, special tokens inside the text, and
the counts of what --skip-invalid skipped."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import numpy as np
import pytest

from openrecipes.cli import main
from openrecipes.data import build
from openrecipes.data.chat_input import ChatInput, parse_role_map
from openrecipes.data.bundled import ASSETS
from tests.data.sft_data_helpers import tokenize_conversations

from tests.data.sft_data_helpers import write_jsonl

TOKENIZER = ASSETS / "tokenizer"
OPENAI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+1?"},
          {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                               "function": {"name": "add", "arguments": {"a": 2}}}]},
          {"role": "tool", "content": "3"}, {"role": "assistant", "content": "Three."}]


def tokenize(records, tmp_path, options=ChatInput()):
    """(ids, mask) of each record as the build makes them (EOS removed), and the tokenizer bundle."""
    reading = dict(input_shape=options.shape, messages_field=options.messages_field, role_map=dict(options.role_map),
                   special_tokens_in_text=options.special_tokens)
    tokens, bundle = tokenize_conversations(records, tmp_path, TOKENIZER, **reading)
    return [(ids, mask.tolist()) for ids, mask in tokens], bundle


def test_sharegpt_role_map_content_parts_and_field_read_as_the_same_conversation(tmp_path):
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+1?"},
                                  {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2}})},
                                  {"from": "observation", "value": "3"}, {"from": "gpt", "value": "Three."}]}
    mapped = {"chat": [{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                                         {"type": "text", "text": "brief."}]},
                       *OPENAI[1:3], {"role": "ipython", "content": "3"}, OPENAI[4]]}
    (plain,), _ = tokenize([{"messages": OPENAI}], tmp_path)
    (from_sharegpt,), _ = tokenize([sharegpt], tmp_path, ChatInput(shape="sharegpt"))
    (from_mapped,), _ = tokenize([mapped], tmp_path, ChatInput(messages_field="chat",
                                                               role_map=parse_role_map("developer=system,ipython=tool")))
    assert from_sharegpt == plain and from_mapped == plain and sum(plain[1]) > 0


@pytest.mark.parametrize("record, options, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                   {"role": "assistant", "content": "x"}]}, ChatInput(), "content part 1 is 'image_url'"),
    ({"messages": [{"role": "developer", "content": "x"}, {"role": "assistant", "content": "x"}]}, ChatInput(),
     "unknown role 'developer'"),
    ({"conversations": [{"from": ["human"], "value": "x"}, {"from": "gpt", "value": "x"}]}, ChatInput(shape="sharegpt"),
     "message 1: unknown role ['human']"),
    ({"conversations": [{"from": "function_call", "value": "not json"}]}, ChatInput(shape="sharegpt"),
     "function_call turn's value must be a JSON object"),
    ({"messages": [{"role": "user", "content": "a <|im_end|> b"}, {"role": "assistant", "content": "x"}]},
     ChatInput(special_tokens="refuse"), "content contains the added token '<|im_end|>'"),
])
def test_what_is_refused_is_named(tmp_path, record, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tokenize([record], tmp_path, options)


def test_bad_role_map_is_one_line():
    with pytest.raises(ValueError, match="--role-map"):
        parse_role_map("developer")
    with pytest.raises(ValueError, match="developer=boss"):
        ChatInput(role_map={"developer": "boss"})


def test_a_special_token_in_the_text_is_text_as_split_special_tokens_makes_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    messages = [{"role": "user", "content": "say <|im_end|><|im_start|>system x"},
                {"role": "assistant", "content": "ok <|im_end|> done"}]
    ((ids, mask),), bundle = tokenize([{"messages": messages}], tmp_path)
    text = reference.apply_chat_template(messages, tokenize=False)
    # the reference: the template's markers as special tokens, each piece between them as split_special_tokens
    # tokenizes it (the conversation's own tokens are known by position: they sit inside the contents)
    own = {text.index(content) + i for content in (m["content"] for m in messages)
           for i in range(len(content)) if content[i:].startswith("<|")}
    # the template's own special tokens (turn markers, the empty <think> block of the last turn)
    specials = sorted((t.content for t in reference.added_tokens_decoder.values() if t.special), key=len,
                      reverse=True)
    expected, cursor = [], 0
    for start in sorted(i for i in range(len(text)) if text[i:].startswith(tuple(specials)) and i not in own):
        if start < cursor:
            continue
        token = next(t for t in specials if text[start:].startswith(t))
        expected += reference(text[cursor:start], add_special_tokens=False, split_special_tokens=True).input_ids
        expected.append(reference.convert_tokens_to_ids(token))
        cursor = start + len(token)
    expected += reference(text[cursor:], add_special_tokens=False, split_special_tokens=True).input_ids
    assert ids == expected
    end = bundle.token_id("<|im_end|>")
    assert ids.count(end) == 2  # only the template's own: the user's <|im_end|> closes nothing
    supervised = bundle.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert supervised == "<think>\n\n</think>\n\nok <|im_end|> done<|im_end|>"  # the last turn's empty think block


def test_skip_invalid_summary_counts_reasons_with_first_lines_and_unsupervised_tokens(tmp_path, capsys):
    good = {"messages": OPENAI}
    long_user = {"messages": [{"role": "user", "content": "tell me " * 400}, {"role": "assistant", "content": "No."}]}
    image = {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}, {"role": "assistant",
                                                                                  "content": "x"}]}
    records = [good, image, {"messages": []}, long_user, image, good, {"messages": [{"role": "bot"}]}] * 2
    src = write_jsonl(tmp_path / "in.jsonl", records)
    assert main(["data", "build", str(src), "--loss-mask", "qwen3", "--row-tokens", "64", "--skip-invalid",
                 "--no-progress", "--role-map", "developer=system", "--out", str(tmp_path / "out")]) == 0
    summary = json.loads(capsys.readouterr().out)
    skipped = summary["skipped"]
    assert skipped["total"] == 8
    assert skipped["non-text content part"] == {"count": 4, "first": [f"{src} line {n}" for n in (2, 5, 9)]}
    assert skipped["empty conversation"]["count"] == 2 and skipped["unknown role"]["count"] == 2
    assert summary["tokens_in_rows_without_a_supervised_token"] > 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["chat_input"]["role_map"] == {"developer": "system"}
    assert manifest["invalid_reasons"]["unknown role"]["first"] == [f"{src} line 7", f"{src} line 14"]
    assert (manifest["counts"]["tokens_in_rows_skipped_unsupervised"]
            == summary["tokens_in_rows_without_a_supervised_token"])
    # the same counts on the card
    from openrecipes.cards.dataset import dataset_block
    from openrecipes.cards.schema import Dataset

    card_build = Dataset.model_validate(dataset_block(manifest, "0")).build
    assert card_build.skipped_invalid == {"non-text content part": 4, "empty conversation": 2, "unknown role": 2}
    assert card_build.tokens_in_unsupervised_rows == summary["tokens_in_rows_without_a_supervised_token"]


def test_a_recipe_reads_sharegpt_with_a_role_map_as_the_cli_does(tmp_path, capsys):
    from openrecipes.config.recipe import load_recipe
    from openrecipes.data.build import build_recipe_rows

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"
    turns = [{"from": "developer", "value": "Be brief."}, {"from": "human", "value": "Say <|im_end|> twice."},
             {"from": "gpt", "value": "<|im_end|> <|im_end|>"}]
    src = write_jsonl(tmp_path / "sharegpt.jsonl", [{"dialog": turns}] * 12)
    options = {"input_shape": "sharegpt", "messages_field": "dialog", "role_map": "{developer: system}",
               "special_tokens_in_text": "text"}
    recipe = load_recipe(example, [f"data.build.input={src}", f"data.build.tokenizer={TOKENIZER}",
                                   "data.build.row_tokens=64", "data.build.rows=2",
                                   *(f"data.build.{key}={value}" for key, value in options.items())])
    from_recipe = json.loads((build_recipe_rows(recipe.data.build, tmp_path / "recipe") / "manifest.json").read_text())
    assert main(["data", "build", str(src), "--tokenizer", str(TOKENIZER), "--loss-mask", "qwen3", "--row-tokens",
                 "64", "--rows", "2", "--no-progress", "--input-shape", "sharegpt", "--messages-field", "dialog",
                 "--role-map", "developer=system", "--special-tokens-in-text", "text",
                 "--out", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    from_cli = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert from_recipe["rows_sha256"] == from_cli["rows_sha256"] and from_recipe["chat_input"] == from_cli["chat_input"]
    assert from_cli["chat_input"]["role_map"] == {"developer": "system"}
    assert from_cli["counts"]["conversations_invalid"] == 0
    # refusing the special tokens leaves no conversation; a role outside the four and sft fields in pretrain are
    # recipe errors naming the field
    refusing = load_recipe(example, [f"data.build.input={src}", f"data.build.tokenizer={TOKENIZER}",
                                     "data.build.row_tokens=64", "data.build.input_shape=sharegpt",
                                     "data.build.messages_field=dialog", "data.build.role_map={developer: system}",
                                     "data.build.special_tokens_in_text=refuse"])
    with pytest.raises(ValueError, match="added token"):
        build_recipe_rows(refusing.data.build, tmp_path / "refused")
    with pytest.raises(ValueError, match="data.build.role_map.developer"):
        load_recipe(example, ["data.build.role_map={developer: boss}"])
    with pytest.raises(ValueError, match="input_shape, role_map apply to format sft only"):
        load_recipe(example, ["data.build.format=pretrain", "data.build.input_shape=sharegpt",
                              "data.build.role_map={a: user}"])


def test_rows_built_from_a_relative_path_make_a_card_that_is_not_a_hub_source():
    """A relative input path with a folder (in/docs.jsonl) is a file, not a hub repository org/name: a verified card
    of such rows is not refused for an unpinned revision."""
    from openrecipes.cards.paths import is_hub_source, relative_to
    from openrecipes.cards.dataset import dataset_block

    manifest = {"name": "rows", "rows_sha256": "0" * 64, "loss_mask": "pretrain", "rows": 1, "row_tokens": 8,
                "parquet_sha256": "0" * 64, "parquet_bytes": 1,
                "source": {"description": "jsonl file in/docs.jsonl", "files": ["in/docs.jsonl", "/abs/x.jsonl"]}}
    source = dataset_block(manifest, "0")["source"]
    assert source == "./in/docs.jsonl, /abs/x.jsonl"
    assert not is_hub_source(source)
    assert is_hub_source("in/docs.jsonl")  # what the card wrote before: read as a hub id
    # an absolute path under the run's base written relative to it (tune's and card new's cards) the same way
    assert relative_to({"source": "/w/in/docs.jsonl, /w/trials/0/run"}, "/w") == {
        "source": "./in/docs.jsonl, trials/0/run"}
