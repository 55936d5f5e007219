"""Time `openrecipes data build --format pretrain` on generated text documents (CPU; no GPU needed).

    PYTHONPATH=src python bench/pretrain_build.py --rows 1600 --row-tokens 8192 [--json out.json]
    PYTHONPATH=src python bench/pretrain_build.py --indexed ...   # the same documents as a Megatron dataset

Generates documents the way the bundled ones are made (make_documents.py over generated conversations,
a different seed), then times one build with the bundled tokenizer. The time covers the whole build: scan,
tokenize (or read the indexed dataset), pack, parquet write, hashes.
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

import numpy as np

from openrecipes.data.assets.make_conversations import generate
from openrecipes.data.assets.make_documents import document_text
from openrecipes.config.recipe import DataBuild
from openrecipes.data.build import build
from openrecipes.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer
from openrecipes.utils import atomic_write_text

TOKENS_PER_DOCUMENT_LOW = 45  # with the bundled tokenizer, with margin: too few documents fails loudly
EOS = "<|endoftext|>"


def _write_indexed(prefix: Path, texts: list[str]) -> None:
    """A Megatron indexed dataset of the tokenized texts (uint16, one sequence per document, no end token)."""
    tokenizer = load_tokenizer(BUNDLED_TOKENIZER).tokenizer
    ids = [np.asarray(e.ids, dtype=np.uint16) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.array([a.size for a in ids], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * 2)[:-1]])
    np.concatenate(ids).tofile(f"{prefix}.bin")
    with open(f"{prefix}.idx", "wb") as handle:
        handle.write(b"MMIDIDX\x00\x00" + np.uint64(1).tobytes() + np.uint8(8).tobytes()
                     + np.uint64(len(ids)).tobytes() + np.uint64(len(ids) + 1).tobytes())
        handle.write(lengths.tobytes() + pointers.astype("<i8").tobytes() + np.arange(len(ids) + 1).astype("<i8").tobytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1600)
    parser.add_argument("--row-tokens", type=int, default=8192)
    parser.add_argument("--indexed", action="store_true", help="read the documents from a Megatron indexed dataset")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args()
    count = args.rows * args.row_tokens // TOKENS_PER_DOCUMENT_LOW + 1000
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        texts = [document_text(record) for record in generate(count, 1)]
        if args.indexed:
            source = Path(tmp) / "documents"
            _write_indexed(source, texts)
        else:
            source = Path(tmp) / "documents.jsonl"
            source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        generate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        manifest = build(DataBuild(input=str(source), tokenizer=str(BUNDLED_TOKENIZER), format="pretrain",
                                   eos_token=EOS, row_tokens=args.row_tokens, rows=args.rows, seed=42),
                         Path(tmp) / "rows")
        build_s = time.perf_counter() - t0
    tokens = manifest["rows"] * manifest["row_tokens"]
    result = {
        "benchmark": "pretrain_build", "input": "megatron indexed" if args.indexed else "jsonl text",
        "rows": manifest["rows"], "row_tokens": manifest["row_tokens"], "tokens": tokens,
        "documents_generated": count, "documents_used": manifest["counts"]["documents_used"],
        "build_seconds": round(build_s, 2), "tokens_per_second": round(tokens / build_s),
        "generate_seconds": round(generate_s, 2), "tokenizer": "bundled 1,024-token byte-level BPE",
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        atomic_write_text(args.json, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
