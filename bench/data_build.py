"""Time `openrecipes data build` on generated conversations (CPU; no GPU needed).

    PYTHONPATH=src python bench/data_build.py --rows 6400 --row-tokens 8192 [--json out.json]

Generates enough synthetic conversations (the bundled generator, a different seed) to fill the
rows, then times one build with the bundled tokenizer and the qwen3 loss mask. The time covers
the whole build: scan, render, tokenize, pack, parquet write, hashes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from openrecipes.data.assets.make_conversations import write_jsonl
from openrecipes.config.recipe import DataBuild
from openrecipes.data.build import build
from openrecipes.data.tokenizer import BUNDLED_TOKENIZER
from openrecipes.utils import atomic_write_text

# tokens per generated conversation with the bundled tokenizer, measured on the bundled set,
# with margin; too few conversations makes the build fail loudly, never silently
TOKENS_PER_CONVERSATION_LOW = 110


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6400)
    parser.add_argument("--row-tokens", type=int, default=8192)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args()
    count = args.rows * args.row_tokens // TOKENS_PER_CONVERSATION_LOW + 1000
    with tempfile.TemporaryDirectory() as tmp:
        conversations = Path(tmp) / "conversations.jsonl"
        t0 = time.perf_counter()
        write_jsonl(conversations, count, seed=1)
        generate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        manifest = build(DataBuild(input=str(conversations), tokenizer=str(BUNDLED_TOKENIZER), loss_mask="qwen3",
                                   row_tokens=args.row_tokens, rows=args.rows, seed=42), Path(tmp) / "rows")
        build_s = time.perf_counter() - t0
        input_bytes = conversations.stat().st_size
    tokens = manifest["rows"] * manifest["row_tokens"]
    result = {
        "benchmark": "data_build",
        "rows": manifest["rows"], "row_tokens": manifest["row_tokens"], "tokens": tokens,
        "conversations_generated": count, "input_bytes": input_bytes,
        "conversations_used": manifest["counts"]["conversations_used"],
        "build_seconds": round(build_s, 2), "tokens_per_second": round(tokens / build_s),
        "generate_seconds": round(generate_s, 2),
        "tokenizer": "bundled 1,024-token byte-level BPE", "loss_mask": "qwen3",
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        atomic_write_text(args.json, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
