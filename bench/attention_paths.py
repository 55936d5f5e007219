"""Forward + backward time of each attention path on this GPU, for long rows at Qwen3-30B-A3B's attention shape.

32 query heads, 4 key/value heads, head dim 128, bf16, one row. Cases per row length: one causal document, and
packed documents (200-1,800 tokens each, causal within each). Paths: SDPA's cuDNN and flash backends (GQA in the
kernel), flash varlen over cu_seqlens, FlexAttention (compiled, block mask), and the engine's own ``attention``
with each ``kernels.attention`` value. Each figure is the median of several timed calls after warm-up; TFLOP/s
counts the useful (causal, in-document) query-key pairs, forward + backward = 3.5 x the forward's 4·pairs·D·H.
Every path's output is compared with the first path's of its case (cuDNN for one document, the engine's ``auto``
for packed documents; max abs difference), so a fast wrong path shows.

Usage: python bench/attention_paths.py --out attention.json [--lengths 8192,32768,65536,131072]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from openrecipes.models.common.attention import Documents, attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


def document_lengths(tokens: int, packed: bool, seed: int = 0) -> list[int]:
    if not packed:
        return [tokens]
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(200, 1801, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - tokens
    return lengths


def timed(fn, reps: int) -> tuple[float, float]:
    """(median ms, peak GiB) of fn over ``reps`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def paths(q, k, v, lengths: list[int]) -> dict:
    """name -> a function of (q, k, v) in (B, H, T, D) returning the output, for this document layout."""
    tokens = q.shape[2]
    one_document = len(lengths) == 1
    document_ids = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                           torch.tensor(lengths, device=q.device))[None]
    documents = Documents.from_document_ids(document_ids)
    scale = HEAD_DIM ** -0.5
    chosen: dict = {}
    if one_document:
        for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            def run(q, k, v, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            chosen[name] = run
    for backend in ("auto", "sdpa", "varlen"):
        if backend == "sdpa" and not one_document and tokens > 16384:
            continue  # a T x T boolean mask: the math kernel, far too slow and large to be a choice here
        chosen[f"engine {backend}"] = (lambda q, k, v, backend=backend:
                                       attention(q, k, v, scale=scale, documents=documents, backend=backend))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        ids = document_ids[0]
        mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (ids[qi] == ids[ki]), None, None, tokens, tokens,
                                 device=q.device)
        chosen["flex"] = lambda q, k, v: flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    except Exception as error:  # noqa: BLE001  (recorded, not fatal: the other paths still run)
        print(json.dumps({"flex": f"unavailable: {error!r}"[:300]}), flush=True)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="8192,32768,65536,131072")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    report = {"benchmark": "attention_paths", "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "heads": HEADS, "kv_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "results": results}
    for tokens in (int(t) for t in args.lengths.split(",")):
        for packed in (False, True):
            lengths = document_lengths(tokens, packed)
            pairs = sum(n * (n + 1) // 2 for n in lengths)
            flops = 3.5 * 4 * pairs * HEAD_DIM * HEADS
            q = torch.randn(1, HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(1, HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            expected = None
            for name, fn in paths(q, k, v, lengths).items():
                record = {"tokens": tokens, "documents": len(lengths), "path": name}
                try:
                    out = fn(q, k, v)
                    expected = out.detach() if expected is None else expected
                    record["max_abs_diff"] = float((out.detach().float() - expected.float()).abs().max())
                    del out
                    ms, peak = timed(lambda: fn(q, k, v).backward(grad), reps=5 if tokens > 32768 else 15)
                    record.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), peak_gib=round(peak, 2))
                except Exception as error:  # noqa: BLE001  (a path that fails is a result too)
                    record["error"] = f"{type(error).__name__}: {error}"[:300]
                q.grad = k.grad = v.grad = None
                print(json.dumps(record), flush=True)
                results.append(record)
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
            del q, k, v, grad, expected
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
