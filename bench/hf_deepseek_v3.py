"""transformers' DeepseekV3ForCausalLM training throughput on one GPU, at the workload the engine's dsv3_* variants
train (bench/deepseek_v3_workload.py: DeepSeek-V3 real widths, 4 layers, 24 routed experts, one 4,096-token row).

The reference recipe, as the peers' Qwen3-MoE harness runs transformers: random init, pure bf16 (parameters,
gradients and AdamW states bf16; transformers keeps the routers' weights and correction biases fp32),
attn_implementation="sdpa", gradient checkpointing of every decoder layer (use_reentrant=False; --no-recompute keeps
every activation), torch.optim.AdamW(fused=True on CUDA), loss = the model's shifted LM loss (labels=input_ids), no
grad clipping, no torch.compile, the experts through torch's grouped matmul (experts_implementation="grouped_mm")
where the installed transformers offers it for DeepSeek-V3 (else its default experts forward, with a note).
--balanced forces an exact round-robin expert choice (the engine's debug.force_load_balance): the router's matmul and
sigmoid still run and the gating weights are its scores of the forced experts, so the router still gets gradients.

One random row per step; step times synchronised; tokens/s median and mean over the workload's window (steps 5-19 of
25), and the window's tokens over its time (what `openrecipes measure` reports for the engine); MFU with the engine's
N (config.active_params(): every matmul parameter a token touches, LM head included, input embedding and norms not)
over the H100/H200 dense bf16 peak of config/hardware.yaml. Prints one `RESULT {json}` line; --out writes the JSON.

Usage: python bench/hf_deepseek_v3.py --out hf.json [--balanced] [--no-recompute] [--steps 25] [--row-tokens 8192]
       python bench/hf_deepseek_v3.py --tiny --device cpu --steps 3 --out tiny.json   (CPU plumbing only)
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deepseek_v3_workload as workload  # noqa: E402
from peer_harness import (emit, enable_recompute, gpu_peak_flops, load_probe, memory_fields,  # noqa: E402
                          summarize, train)

EXPERTS_IMPLEMENTATION = "grouped_mm"
NORM_FLOOR = 1e-20  # transformers' router adds it to the sum of the kept scores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--steps", type=int, default=workload.STEPS)
    parser.add_argument("--row-tokens", type=int, default=workload.ROW_TOKENS,
                        help="tokens of the one row per step (--tiny: the tiny row length whatever is given)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--balanced", action="store_true", help="force round-robin expert choice (exact balance)")
    parser.add_argument("--no-recompute", action="store_true", help="no gradient checkpointing")
    parser.add_argument("--experts", default=EXPERTS_IMPLEMENTATION, choices=["grouped_mm", "eager"],
                        help="transformers' experts implementation")
    parser.add_argument("--tiny", action="store_true", help="the tiny registered config and short rows (CPU tests)")
    return parser.parse_args(argv)


def round_robin(scores_TE: torch.Tensor, top_k: int, normalize: bool, scaling: float):
    """Expert ids (T, K) assigned round-robin (slot s of the T*K gets expert s mod E: every expert the same load to
    one token) and their gating weights from the router's real sigmoid scores, as transformers weights a choice."""
    tokens, experts = scores_TE.shape
    slots = torch.arange(tokens * top_k, device=scores_TE.device)
    indices_TK = (slots % experts).view(tokens, top_k)
    weights_TK = scores_TE.gather(1, indices_TK)
    if normalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + NORM_FLOOR)
    return indices_TK, weights_TK * scaling


def force_balanced_routing(modeling) -> str:
    """Patch the installed transformers' DeepSeek-V3 routing to ``round_robin``. Two layouts exist in 5.x: the MoE
    block choosing from the router's logits (``route_tokens_to_experts``), or the router choosing itself (returning
    logits, weights, indices). Returns which one was patched, for the record."""
    moe_cls, router_cls = modeling.DeepseekV3MoE, modeling.DeepseekV3TopkRouter
    if hasattr(moe_cls, "route_tokens_to_experts"):
        def route_tokens_to_experts(self, router_logits):
            config = self.config
            indices, weights = round_robin(router_logits.view(-1, config.n_routed_experts).float().sigmoid(),
                                           config.num_experts_per_tok, config.norm_topk_prob,
                                           config.routed_scaling_factor)
            return indices, weights

        moe_cls.route_tokens_to_experts = route_tokens_to_experts
        return "DeepseekV3MoE.route_tokens_to_experts"

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())
        indices, weights = round_robin(logits.sigmoid(), self.top_k, self.norm_topk_prob, self.routed_scaling_factor)
        return logits, weights, indices

    router_cls.forward = forward
    return "DeepseekV3TopkRouter.forward"


def build_model(fields: dict, device: torch.device, experts: str = EXPERTS_IMPLEMENTATION):
    """DeepseekV3ForCausalLM in bf16 on ``device``; the experts implementation asked for where this transformers
    takes the keyword for DeepSeek-V3, its default otherwise (the note says which)."""
    import transformers

    config = transformers.DeepseekV3Config(**fields)
    kwargs = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    note = None
    with device:
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                config, experts_implementation=experts, **kwargs)
        except (TypeError, ValueError, KeyError) as error:
            note = (f"transformers {transformers.__version__} refused experts_implementation="
                    f"{experts!r} for DeepSeek-V3 ({error}); its default experts forward runs")
            print(f"[hf_deepseek_v3] note: {note}", flush=True)
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    return model.to(device), note


def experts_dispatch(model) -> dict:
    """Which experts forward runs: the config's implementation, and whether the experts class dispatches on it at all
    (transformers' ``@use_experts_implementation`` decorator; without it the class's own loop runs whatever the
    config says)."""
    experts = next(layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    source = inspect.getsource(sys.modules[type(experts).__module__])
    return {"experts_implementation": getattr(model.config, "_experts_implementation", None),
            "experts_class": type(experts).__name__,
            "experts_dispatch": "@use_experts_implementation" in source}






def run(args: argparse.Namespace) -> dict:
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    device = torch.device(args.device)
    config = workload.model_config(args.tiny)
    tokens = workload.TINY_ROW_TOKENS if args.tiny else args.row_tokens
    name = ("hf_dsv3" + ("_bal" if args.balanced else "_nat") + ("_none" if args.no_recompute else "")
            + ("" if tokens in (workload.ROW_TOKENS, workload.TINY_ROW_TOKENS) else f"_{tokens}"))
    patched = force_balanced_routing(modeling) if args.balanced else None
    torch.manual_seed(0)
    started = time.perf_counter()
    model, note = build_model(workload.hf_config_fields(args.tiny), device, args.experts)
    build_s = time.perf_counter() - started
    # the engine's model, by count (the routers' correction biases are buffers here, frozen parameters there; an
    # older transformers may hold them as parameters: left out on both sides)
    params = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("e_score_correction_bias"))
    if params != config.total_params():
        print(f"[hf_deepseek_v3] warning: {params:,} parameters, the engine's model has {config.total_params():,}",
              flush=True)
    if not args.no_recompute:
        enable_recompute(model)
    model.train()
    probe = load_probe(model, config.n_routed_experts)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = train(model, steps=args.steps, tokens=tokens, vocab=config.vocab_size, device=device,
                          probe=probe, probe_step=min(args.steps - 1, workload.WINDOW[1] + 1), tag="hf_deepseek_v3")
    mean_load = tokens * config.num_experts_per_tok / config.n_routed_experts
    loads = [c / mean_load for c in probe["counts"].values()]
    result = {
        "variant": name, "framework": f"transformers {transformers.__version__}", "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "model": workload.model_name(args.tiny), "overrides": workload.overrides(args.tiny),
        "row_tokens": tokens, "rows_per_step": 1, "steps": args.steps, "total_params": params,
        "same_params_as_engine": params == config.total_params(),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "attn_implementation": model.config._attn_implementation, **experts_dispatch(model), "experts_note": note,
        "routing": f"forced round-robin ({patched})" if patched else "natural (random init)",
        "grad_ckpt": not args.no_recompute, "compile": False, "precision": "pure bf16 params/grads/AdamW states",
        "optimizer": f"torch.optim.AdamW(fused={device.type == 'cuda'})", "build_s": build_s,
        "load_max_over_mean": [round(c.max().item(), 3) for c in loads],
        "load_min_over_mean": [round(c.min().item(), 3) for c in loads],
        "step_times_s": times, "losses": losses,
        **summarize(times, tokens, workload.WINDOW, config.active_params(), gpu_peak_flops(device)),
        **memory_fields(device),
    }
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
