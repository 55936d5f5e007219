"""The token ids of a rendered conversation are the tokenizer's own (transformers' apply_chat_template), and the
loss mask comes from the supervised character spans."""

import json

import numpy as np
import pytest

from openrecipes.data.bundled import ASSETS
from openrecipes.data.templates import token_mask

from tests.data.sft_data_helpers import tokenize_conversations

TOKENIZER = ASSETS / "tokenizer"
# The reply starting with newlines comes before the last user query, so the qwen3 template keeps it as it is
# (the last turn's content follows an empty <think> block, its leading newlines stripped).
NEWLINE_FIRST = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "\n\nHi there."},
                 {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]


def tokenize(conversations, tmp_path, loss_mask="qwen3"):
    """(ids, mask) of each conversation as the data build makes them, its EOS removed."""
    return tokenize_conversations([{"messages": messages} for messages in conversations], tmp_path,
                                  loss_mask=loss_mask)


def test_ids_equal_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    bundled = [json.loads(line)["messages"] for line in (ASSETS / "conversations.jsonl").read_text().splitlines()]
    conversations = [NEWLINE_FIRST, [{"role": "user", "content": " x"}, {"role": "assistant", "content": "  \n y"}],
                     *bundled[:60]]
    tokens, _ = tokenize(conversations, tmp_path)
    for messages, (ids, _) in zip(conversations, tokens):
        assert ids == list(reference.apply_chat_template(messages, tokenize=True)["input_ids"]), messages


def test_a_newline_first_reply_is_one_tokenization_with_its_content_supervised(tmp_path):
    ((ids, mask),), bundle = tokenize([NEWLINE_FIRST], tmp_path)
    text = bundle.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>assistant\n\n\nHi there.<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nBye.<|im_end|>\n")
    supervised = bundle.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    # the token merging the header's newline with the reply's first ones is supervised (it holds reply text)
    assert supervised == "\n\n\nHi there.<|im_end|><think>\n\n</think>\n\nBye.<|im_end|>"
    assert mask[-1] == 0  # the newline after <|im_end|>


def test_token_mask_overlap_rule():
    spans = [(5, 10), (20, 22)]
    offsets = np.array([[0, 5], [4, 6], [6, 10], [10, 12], [12, 20], [19, 21], [21, 25], [22, 23], [7, 7]])
    assert token_mask(offsets, spans).tolist() == [0, 1, 1, 0, 0, 1, 1, 0, 1]
    assert token_mask(offsets, []).tolist() == [0] * 9


def test_the_miles_mask_also_supervises_the_newline_after_each_turn(tmp_path):
    two_turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Yes."}]
    ((ids, ours),), bundle = tokenize([two_turns], tmp_path / "qwen3")
    ((miles_ids, miles),), _ = tokenize([two_turns], tmp_path / "miles", loss_mask="qwen3_miles")
    assert miles_ids == ids  # the same tokens; only the mask differs
    extra = [i for i in range(len(ids)) if miles[i] and not ours[i]]
    assert len(extra) == 2 and not any(ours[i] and not miles[i] for i in range(len(ids)))
    assert all(bundle.tokenizer.decode([ids[i]]) == "\n" and bundle.tokenizer.decode([ids[i - 1]], skip_special_tokens=False) == "<|im_end|>"
               for i in extra)
