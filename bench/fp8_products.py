"""FP8 against bf16, product by product, at Qwen3-30B-A3B widths on one GPU (forward + both backward products).

Products (one 8,192-token row): the query projection (8,192 x 2,048 -> 4,096), the output projection (4,096 ->
2,048), and the routed experts' gate projection over 65,536 token copies sorted by expert (128 experts of 2,048 ->
768, 512 copies each: forced balance). Each variant runs forward and backward; median of 50 timed repetitions after
two warm-up ones, CUDA events. ``quantize`` times the row-wise quantization alone (compiled, as the products run it) (the FP8 path's extra passes).

Usage: python bench/fp8_products.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from openrecipes.models.common.fp8 import _quantize, fp8_grouped_linear, fp8_linear  # noqa: E402
from openrecipes.models.common.moe import grouped_linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_paths import timed  # noqa: E402  (bench/, beside this file: median of CUDA-event times)

TOKENS, HIDDEN, HEADS_WIDTH, EXPERTS, FFN, TOP_K = 8192, 2048, 4096, 128, 768, 8
REPEATS = 50


def _fwd_bwd(product, x, w, *extra):
    def step():
        out = product(x, w, *extra)
        out.backward(grad)
        x.grad = w.grad = None
    grad = torch.randn_like(product(x, w, *extra))
    return step


def probe_weight_gradient_scales() -> dict:
    """Which scale layout torch._scaled_grouped_mm reads for the 2d-2d product (the experts' weight gradient): one
    (E*O,) vector expert-major, or an (O, E) view; each compared with the dequantized product."""
    from openrecipes.models.common.fp8 import quantize_per_group

    torch.manual_seed(1)
    experts, rows, out_dim, in_dim = 4, 256, 64, 32
    counts = torch.tensor([64, 32, 96, 64], device="cuda")
    group = torch.repeat_interleave(torch.arange(experts, device="cuda"), counts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    grad, x = torch.randn(rows, out_dim, device="cuda"), torch.randn(rows, in_dim, device="cuda")
    qg, sg = quantize_per_group(grad, group, experts)
    qx, sx = quantize_per_group(x, group, experts)
    dg, dx = qg.float() * sg[group], qx.float() * sx[group]
    expected = torch.stack([g.t() @ xx for g, xx in zip(dg.split(counts.tolist()), dx.split(counts.tolist()))])
    found = {}
    for name, (a, b) in {"flat_expert_major": (sg.flatten(), sx.flatten()), "transposed_view": (sg.t(), sx.t())}.items():
        try:
            got = torch._scaled_grouped_mm(qg.t().contiguous(), qx.t().contiguous().t(), a, b, offs=offsets,
                                           out_dtype=torch.float32)
            found[name] = ((got - expected).norm() / expected.norm()).item()
        except Exception as error:  # the probe's point: which layout the kernel takes
            found[name] = repr(error)[:200]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    probe = probe_weight_gradient_scales()
    print(f"RESULT probe 2d-2d scales: {probe}", flush=True)
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    rows = TOKENS * TOP_K
    counts = torch.full((EXPERTS,), rows // EXPERTS, device="cuda")
    cases = {
        "q_proj": (torch.randn(TOKENS, HIDDEN, **bf16), torch.randn(HEADS_WIDTH, HIDDEN, **bf16) * 0.02, ()),
        "o_proj": (torch.randn(TOKENS, HEADS_WIDTH, **bf16), torch.randn(HIDDEN, HEADS_WIDTH, **bf16) * 0.02, ()),
        "experts_gate": (torch.randn(rows, HIDDEN, **bf16), torch.randn(EXPERTS, FFN, HIDDEN, **bf16) * 0.02,
                         (counts,)),
    }
    results = []
    for name, (x, w, extra) in cases.items():
        x.requires_grad_(), w.requires_grad_()
        grouped = bool(extra)
        flops = 3 * 2 * x.shape[0] * x.shape[1] * w.shape[-2]
        variants = {"bf16": (lambda a, b, c: grouped_linear(a, b, c, backend="grouped_mm")) if grouped else F.linear,
                    "fp8": fp8_grouped_linear if grouped else fp8_linear}
        row = {"product": name, "shape": [list(x.shape), list(w.shape)], "flops_fwd_bwd": flops}
        for variant, product in variants.items():
            ms = timed(_fwd_bwd(product, x, w, *extra), REPEATS)[0]
            row[f"{variant}_ms"] = ms
            row[f"{variant}_tflops"] = flops / ms / 1e9
        row["quantize_ms"] = timed(lambda: _quantize(x, 1), REPEATS)[0]
        row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        results.append(row)
        print(f"RESULT {name}: bf16 {row['bf16_ms']:.3f} ms ({row['bf16_tflops']:.0f} TFLOP/s), fp8 "
              f"{row['fp8_ms']:.3f} ms ({row['fp8_tflops']:.0f}), x{row['speedup']:.2f}; quantize x "
              f"{row['quantize_ms']:.3f} ms", flush=True)
    report = {"benchmark": "fp8_products", "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "probe_2d2d_scales": probe,
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
