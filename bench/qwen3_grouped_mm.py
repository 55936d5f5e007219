"""Reduced-depth Qwen3-30B-A3B (real widths, 4 layers), bf16 forward + backward of one 8,192-token sequence:
the grouped-mm expert path against the exact per-expert loop, both against an fp32 run of the same weights.

"Within bf16 rounding" is judged against the fp32 run: the grouped-mm path's error must be no larger than
twice the loop path's error (both paths round to bf16 at the same places; only the matmul kernels differ).

Usage: python bench/qwen3_grouped_mm.py --out results.json [--layers 4] [--tokens 8192] [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from openrecipes.models.common.moe import GroupedExperts  # noqa: E402
from openrecipes.models.qwen3_moe import build_qwen3_moe  # noqa: E402
from openrecipes.models.registry import get_config  # noqa: E402



def set_expert_backend(model: torch.nn.Module, backend: str) -> None:
    """Switch the expert kernel of a built model (the engine chooses it at build time, KernelOptions.experts)."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.backend = backend

def forward_backward(model, input_ids):
    for param in model.parameters():
        param.grad = None
    logits = model(input_ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    grads = {name: param.grad.float() for name, param in model.named_parameters()}
    return loss.detach().float(), logits.detach().float(), grads


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def timed(model, input_ids, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for param in model.parameters():
            param.grad = None
        logits = model(input_ids)
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten()).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    config = replace(get_config("qwen3-30b-a3b"), num_hidden_layers=args.layers)
    device = torch.device("cuda")
    input_ids = torch.randint(0, config.vocab_size, (1, args.tokens),
                              generator=torch.Generator().manual_seed(0)).to(device)

    model = build_qwen3_moe(config, device=device, dtype=torch.float32, seed=0)
    set_expert_backend(model, "loop")
    ref_loss, ref_logits, ref_grads = forward_backward(model, input_ids)
    model = model.to(torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()

    results: dict = {}
    for backend in ("grouped_mm", "loop"):
        set_expert_backend(model, backend)
        loss, logits, grads = forward_backward(model, input_ids)
        worst = max(grads, key=lambda n: rel_l2(grads[n], ref_grads[n]))
        times = timed(model, input_ids, args.iters)
        median = sorted(times)[len(times) // 2]
        results[backend] = {
            "loss": loss.item(), "loss_abs_err_vs_fp32": abs(loss.item() - ref_loss.item()),
            "logits_rel_l2_vs_fp32": rel_l2(logits, ref_logits),
            "worst_grad_rel_l2_vs_fp32": rel_l2(grads[worst], ref_grads[worst]), "worst_grad_tensor": worst,
            "step_times_s": times, "median_step_s": median, "tokens_per_s": args.tokens / median,
        }
        results[backend]["_grads"], results[backend]["_logits"] = grads, logits
    gm, lp = results["grouped_mm"], results["loop"]
    comparison = {
        "logits_rel_l2_grouped_vs_loop": rel_l2(gm["_logits"], lp["_logits"]),
        "worst_grad_rel_l2_grouped_vs_loop": max(rel_l2(gm["_grads"][n], lp["_grads"][n]) for n in gm["_grads"]),
        "within_bf16_rounding": (gm["logits_rel_l2_vs_fp32"] <= 2 * lp["logits_rel_l2_vs_fp32"]
                                 and gm["worst_grad_rel_l2_vs_fp32"] <= 2 * lp["worst_grad_rel_l2_vs_fp32"]
                                 and gm["loss_abs_err_vs_fp32"] <= 2 * lp["loss_abs_err_vs_fp32"] + 1e-3),
        "speedup_grouped_over_loop": lp["median_step_s"] / gm["median_step_s"],
    }
    for arm in results.values():
        del arm["_grads"], arm["_logits"]
    report = {
        "benchmark": "qwen3_grouped_mm", "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "settings": {"model": "qwen3-30b-a3b widths", "layers": args.layers, "tokens": args.tokens,
                     "dtype": "bf16 params and activations; fp32 reference of the same weights",
                     "iters": args.iters, "routing": "natural (random init)", "attention": "sdpa causal"},
        "fp32_reference_loss": ref_loss.item(), "results": results, "comparison": comparison,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
