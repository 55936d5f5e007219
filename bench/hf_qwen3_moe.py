"""transformers' Qwen3MoeForCausalLM training throughput on one GPU, at the workload the engine's single_* workloads
train (bench/workloads.yaml): Qwen3-30B-A3B at real widths and reduced depth (8 layers), one random row of 8,192
tokens per step.

The model is the engine's: openrecipes' registered qwen3-30b-a3b config, with the depth asked for, written as
transformers' Qwen3MoeConfig (config.to_hf_dict(), the same fields `convert export` writes), so both sides train the
same tensors (the parameter count is checked against the engine's). The reference recipe, as a user of transformers
runs it: random init, pure bf16 (parameters, gradients and AdamW states), attn_implementation="sdpa", the experts
through torch's grouped matmul (experts_implementation="grouped_mm"; "eager" is the per-expert loop), gradient
checkpointing of every decoder layer (use_reentrant=False; --no-recompute keeps every activation),
torch.optim.AdamW(fused=True on CUDA), loss = the model's shifted LM loss (labels=input_ids, router aux loss off as in
the Qwen3-30B-A3B config), no grad clipping, no torch.compile (bench/peer_harness.py: the step and its timing).
--balanced forces an exact round-robin expert choice (the engine's debug.force_load_balance): the router's matmul and
softmax still run and the gating weights are its probabilities of the forced experts, so the router gets gradients.
--lora trains the engine's LoRA workloads' adapters (bench/workloads.py LORA: rank, alpha and targets) through peft:
LoraConfig target_modules for the attention projections and target_parameters mlp.experts.gate_up_proj / down_proj
for every routed expert (one rank-r adapter per expert, as the engine's), the base frozen in bf16, AdamW over the
adapters only, the adapters in the dtype peft gives them by default (fp32).

Statistics over --window (0-based steps, inclusive; default the engine's for --steps); MFU with the engine's N
(config.active_params()) over the dense bf16 peak of config/hardware.yaml. Prints one `RESULT {json}` line.

Usage: python bench/hf_qwen3_moe.py --out hf.json [--balanced] [--no-recompute] [--lora] [--layers 8]
       [--row-tokens 8192]
       python bench/hf_qwen3_moe.py --tiny --device cpu --steps 3 --out tiny.json   (CPU plumbing only)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from openrecipes.models.resolve import resolve_model_config  # noqa: E402
from peer_harness import (emit, gpu_peak_flops, hf_rope_fields, loads, lora_fields, memory_fields,  # noqa: E402
                          prepare_and_train, summarize)
from workloads import default_window  # noqa: E402


MODEL, TINY_MODEL = "qwen3-30b-a3b", "qwen3-moe-tiny"
TINY_ROW_TOKENS = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--window", default=None, help="FIRST,LAST (0-based steps); default the engine's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "eager"])
    parser.add_argument("--balanced", action="store_true", help="force round-robin expert choice (exact balance)")
    parser.add_argument("--no-recompute", action="store_true", help="no gradient checkpointing")
    parser.add_argument("--lora", action="store_true",
                        help="train peft adapters of the LoRA workloads (bench/workloads.py LORA) on a frozen base")
    parser.add_argument("--tiny", action="store_true",
                        help=f"the registered {TINY_MODEL} and {TINY_ROW_TOKENS}-token rows (CPU tests)")
    return parser.parse_args(argv)


def model_config(layers: int, tiny: bool):
    """The openrecipes config the engine trains: the registered model at ``layers`` layers (tiny: as registered)."""
    return resolve_model_config(TINY_MODEL, overrides={}) if tiny else \
        resolve_model_config(MODEL, overrides={"num_hidden_layers": layers})


def hf_config_fields(config) -> dict:
    return hf_rope_fields(config.to_hf_dict())


def force_balanced_routing(modeling) -> str:
    """Replace Qwen3MoeTopKRouter.forward (transformers 5.x: it returns logits, weights and expert ids) with one
    whose ids are round-robin: slot s of the tokens' T*K choices gets expert s mod E, every expert the same load."""
    router_cls = modeling.Qwen3MoeTopKRouter

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        slots = torch.arange(probs.shape[0] * self.top_k, device=probs.device)
        indices = (slots % self.num_experts).view(-1, self.top_k)
        weights = probs.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), indices

    router_cls.forward = forward
    return "Qwen3MoeTopKRouter.forward"


def build_model(fields: dict, device: torch.device, experts: str):
    import transformers

    config = transformers.Qwen3MoeConfig(**fields)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                              experts_implementation=experts)
    return model.to(device)


def run(args: argparse.Namespace) -> dict:
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

    device = torch.device(args.device)
    config = model_config(args.layers, args.tiny)
    tokens = TINY_ROW_TOKENS if args.tiny else args.row_tokens
    window = tuple(int(s) for s in args.window.split(",")) if args.window else default_window(args.steps)
    name = "hf_qwen3" + ("_bal" if args.balanced else "_nat") + ("_none" if args.no_recompute else "") + \
        ("_lora" if args.lora else "")
    patched = force_balanced_routing(modeling) if args.balanced else None
    torch.manual_seed(0)
    started = time.perf_counter()
    model = build_model(hf_config_fields(config), device, args.experts)
    build_s = time.perf_counter() - started
    params, dtypes = sum(p.numel() for p in model.parameters()), sorted({str(p.dtype) for p in model.parameters()})
    if params != config.total_params():
        print(f"[hf_qwen3_moe] warning: {params:,} parameters, the engine's model has {config.total_params():,}",
              flush=True)
    hf_model = model
    model, probe, times, losses = prepare_and_train(
        model, experts=config.num_experts, recompute=not args.no_recompute, lora=args.lora, steps=args.steps,
        tokens=tokens, vocab=config.vocab_size, device=device, probe_step=min(args.steps - 1, window[1] + 1),
        tag="hf_qwen3_moe")
    return {
        "variant": name, "framework": f"transformers {transformers.__version__}", "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "model": TINY_MODEL if args.tiny else MODEL, "layers": config.num_hidden_layers,
        "row_tokens": tokens, "rows_per_step": 1, "steps": args.steps, "total_params": params,
        "same_params_as_engine": params == config.total_params(), "param_dtypes": dtypes,
        "attn_implementation": hf_model.config._attn_implementation,
        "experts_implementation": getattr(hf_model.config, "_experts_implementation", None),
        "routing": f"forced round-robin ({patched})" if patched else "natural (random init)",
        "grad_ckpt": not args.no_recompute, "compile": False,
        "precision": "pure bf16 params/grads/AdamW states", "build_s": build_s,
        "optimizer": f"torch.optim.AdamW(fused={device.type == 'cuda'})",
        **(lora_fields(model, device) if args.lora else {}),
        **loads(probe, tokens, config.num_experts_per_tok, config.num_experts),
        "step_times_s": times, "losses": losses,
        **summarize(times, tokens, window, config.active_params(), gpu_peak_flops(device)),
        **memory_fields(device),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
