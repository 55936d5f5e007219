"""Train the bundled byte-level BPE tokenizer on the bundled conversations.

The tokenizer is small on purpose: its whole vocabulary, special tokens included, fits the
tiny test model (vocab_size 1024). Run from the repository root after make_conversations.py:

    PYTHONPATH=src python src/openrecipes/data/assets/make_tokenizer.py

Writes ``tokenizer/`` beside this file: tokenizer.json, tokenizer_config.json and
chat_template.jinja (a copy of templates/qwen3.jinja).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).parent
VOCAB_SIZE = 1024
# Document separators and turn markers of both formats, then the tag tokens of Qwen3's format.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]
# Splits text into words, single digits, punctuation runs and whitespace runs before BPE,
# so merges never cross those classes.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def training_texts(conversations: Path) -> list[str]:
    """Every bundled conversation rendered with both built-in templates."""
    from openrecipes.data.templates import BUILTIN_TEMPLATES, compile_template

    records = [json.loads(line) for line in conversations.read_text(encoding="utf-8").splitlines() if line]
    texts = []
    for name, path in sorted(BUILTIN_TEMPLATES.items()):
        template = compile_template(path.read_text(encoding="utf-8"))
        kwargs = {"current_date": "2026-10-01", "reasoning_effort": "high"} if name == "muse_spark" else {}
        for record in records:
            texts.append(template.render(messages=record["messages"], tools=record["metadata"].get("tools"),
                                         add_generation_prompt=False, **kwargs))
    return texts


def train(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {size} tokens, more than {VOCAB_SIZE}")
    return tokenizer


def main() -> None:
    from openrecipes.utils import atomic_output_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=Path, default=HERE / "conversations.jsonl")
    parser.add_argument("--out", type=Path, default=HERE / "tokenizer")
    args = parser.parse_args()
    tokenizer = train(training_texts(args.conversations))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
    }
    with atomic_output_dir(args.out, overwrite=True) as staging:
        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (staging / "chat_template.jinja").write_text(
            (HERE / "templates" / "qwen3.jinja").read_text(encoding="utf-8"), encoding="utf-8")
    print(f"wrote {args.out} ({tokenizer.get_vocab_size(with_added_tokens=True)} tokens)")


if __name__ == "__main__":
    main()
