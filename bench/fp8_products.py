"""FP8 against bf16, product by product, at Qwen3-30B-A3B widths on one GPU (forward + both backward products).

Products (one 8,192-token row): the query projection (8,192 x 2,048 -> 4,096), the output projection (4,096 ->
2,048), and the routed experts' gate projection over 65,536 token copies sorted by expert (128 experts of 2,048 ->
768): 512 copies each (forced balance), or counts drawn from a skewed routing (ragged: the weight gradient pads).
Each product runs eager (the FP8 quantization compiled on its own) and compiled whole (``torch.compile`` of the
product: quantization fused into the transposes, as compiled blocks run it). Median of 50 timed repetitions after
two warm-up ones, CUDA events; the compiled FP8 experts' kernels are profiled once (the top of the table is printed),
and the experts' three grouped products are timed as kernels alone, bf16 against FP8 (``grouped_kernels_alone``).

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
from openrecipes.models.common.fp8 import fp8_grouped_linear, fp8_linear  # noqa: E402
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


def _skewed_counts(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Per-expert row counts summing to ``rows`` from a Zipf-like routing: most counts not a multiple of 16."""
    weights = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** 0.8
    return torch.multinomial(weights, rows, replacement=True, generator=generator).bincount(minlength=EXPERTS)


def _profile_top(step, rows: int = 12) -> str:
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def grouped_kernels_alone(counts: torch.Tensor) -> dict[str, float]:
    """The experts' three grouped products as kernels alone (operands quantized beforehand), bf16 against FP8, ms:
    which product the FP8 grouped kernel loses on (forward and input gradient: ragged rows as M; weight gradient:
    rows as K, padded to 16)."""
    # the padded transposed quantization as the engine runs it (compiled on CUDA: eager index_copy has no e4m3 kernel)
    from openrecipes.models.common.fp8 import _padding, _quantize_columns_padded, quantize

    rows, bf16 = int(counts.sum()), dict(device="cuda", dtype=torch.bfloat16)
    x, grad = torch.randn(rows, HIDDEN, **bf16), torch.randn(rows, FFN, **bf16)
    w = torch.randn(EXPERTS, FFN, HIDDEN, **bf16) * 0.02
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    dest, ends, width = _padding(counts, rows)
    (qx, sx), (qg, sg), (qw, sw) = quantize(x, 1), quantize(grad, 1), quantize(w, 2)
    qwt, swt = quantize(w.transpose(-2, -1), 2)
    (qg_t, sg_c), (qx_t, sx_c) = _quantize_columns_padded(grad, dest, width), _quantize_columns_padded(x, dest, width)
    out = {
        "forward_bf16": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets),
        "forward_fp8": lambda: torch._scaled_grouped_mm(qx, qw.transpose(-2, -1), sx.squeeze(1), sw.squeeze(2),
                                                        offs=offsets, out_dtype=torch.bfloat16),
        "input_grad_bf16": lambda: torch._grouped_mm(grad, w, offs=offsets),
        "input_grad_fp8": lambda: torch._scaled_grouped_mm(qg, qwt.transpose(-2, -1), sg.squeeze(1), swt.squeeze(2),
                                                           offs=offsets, out_dtype=torch.bfloat16),
        "weight_grad_bf16": lambda: torch._grouped_mm(grad.t(), x, offs=offsets),
        "weight_grad_fp8": lambda: torch._scaled_grouped_mm(qg_t, qx_t.t(), sg_c.repeat(EXPERTS),
                                                            sx_c.repeat(EXPERTS), offs=ends,
                                                            out_dtype=torch.bfloat16),
    }
    found = {}
    for name, fn in out.items():
        try:
            found[name] = timed(fn, REPEATS)[0]
        except Exception as error:  # a refused layout is a result
            found[name] = repr(error)[:200]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    rows = TOKENS * TOP_K
    balanced = torch.full((EXPERTS,), rows // EXPERTS, device="cuda")
    skewed = _skewed_counts(rows, torch.Generator().manual_seed(0)).cuda()
    experts_x, experts_w = torch.randn(rows, HIDDEN, **bf16), torch.randn(EXPERTS, FFN, HIDDEN, **bf16) * 0.02
    cases = {
        "q_proj": (torch.randn(TOKENS, HIDDEN, **bf16), torch.randn(HEADS_WIDTH, HIDDEN, **bf16) * 0.02, ()),
        "o_proj": (torch.randn(TOKENS, HEADS_WIDTH, **bf16), torch.randn(HIDDEN, HEADS_WIDTH, **bf16) * 0.02, ()),
        "experts_gate": (experts_x, experts_w, (balanced,)),
        "experts_gate_skewed": (experts_x, experts_w, (skewed,)),
    }
    results, profile = [], None
    for name, (x, w, extra) in cases.items():
        x.requires_grad_(), w.requires_grad_()
        grouped = bool(extra)
        flops = 3 * 2 * x.shape[0] * x.shape[1] * w.shape[-2]
        bf16_product = (lambda a, b, c: grouped_linear(a, b, c, backend="grouped_mm")) if grouped else F.linear
        fp8_product = fp8_grouped_linear if grouped else fp8_linear
        variants = {"bf16": bf16_product, "fp8": fp8_product,
                    "bf16_compiled": torch.compile(bf16_product), "fp8_compiled": torch.compile(fp8_product)}
        row = {"product": name, "shape": [list(x.shape), list(w.shape)], "flops_fwd_bwd": flops}
        if grouped:
            row["counts_multiple_of_16"] = int((extra[0] % 16 == 0).sum())
        for variant, product in variants.items():
            try:
                ms = timed(_fwd_bwd(product, x, w, *extra), REPEATS)[0]
            except Exception as error:  # one variant's failure is a result, the others still run
                row[f"{variant}_error"] = repr(error)[:300]
                continue
            row[f"{variant}_ms"], row[f"{variant}_tflops"] = ms, flops / ms / 1e9
        for mode in ("", "_compiled"):
            if f"fp8{mode}_ms" in row and f"bf16{mode}_ms" in row:
                row[f"speedup{mode}"] = row[f"bf16{mode}_ms"] / row[f"fp8{mode}_ms"]
        results.append(row)
        print(f"RESULT {json.dumps(row)}", flush=True)
        if name == "experts_gate_skewed" and "fp8_compiled_ms" in row:
            profile = _profile_top(_fwd_bwd(variants["fp8_compiled"], x, w, *extra))
            print(profile, flush=True)
    alone = {name: grouped_kernels_alone(c) for name, c in (("balanced", balanced), ("skewed", skewed))}
    print(f"RESULT grouped kernels alone (ms): {json.dumps(alone)}", flush=True)
    report = {"benchmark": "fp8_products", "grouped_kernels_alone_ms": alone, "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "results": results,
              "profile_experts_skewed_fp8_compiled": profile}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
