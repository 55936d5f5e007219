"""transformers' gpt-oss, GLM-4.5-MoE and Qwen3.5-MoE (text) training throughput on one GPU, beside the engine's
gptoss_*, glm45_* and qwen35_* workloads (bench/workloads.yaml): each family at real widths and reduced depth, one
random row per step. One harness for the three families; FAMILIES says what differs between them (transformers'
config and causal LM classes, the router to patch for --balanced, the attention implementation).

The model is the engine's: an openrecipes registered model (--model) with the workload's overrides (--overrides, a
JSON object, as the engine's model_overrides; without it --layers sets the depth and the registered layer_types are
cut to it), written as transformers' config (config.to_hf_dict(), the fields `convert export` writes), so both sides
train the same tensors (the parameter count is checked against the engine's). gpt-oss: the engine dequantizes MXFP4
checkpoints to bf16; here both are random bf16 weights from the config, no checkpoint is read.

The reference recipe is the Qwen3-MoE peer's (bench/hf_qwen3_moe.py, its step in bench/peer_harness.py): random
init, pure bf16 parameters, gradients and AdamW states, the experts through torch's grouped matmul
(experts_implementation="grouped_mm"), gradient checkpointing of every decoder layer (use_reentrant=False;
--no-recompute keeps every activation), torch.optim.AdamW(fused=True on CUDA), the model's shifted LM loss, no
clipping, no torch.compile. Attention: attn_implementation="sdpa" for GLM-4.5 and Qwen3.5's full-attention layers;
gpt-oss's attention sinks are not in transformers' sdpa (GptOssPreTrainedModel._supports_sdpa is False), so it runs
"eager" (what transformers falls back to, and OpenAI's fine-tuning guide for gpt-oss asks for; the sliding window is
in its mask), or --attn flex_attention on a GPU. Qwen3.5's Gated DeltaNet layers run flash-linear-attention's kernels
where `fla` is installed, else transformers' torch fallback (torch_chunk_gated_delta_rule); the result says which.

--balanced: the engine's debug.force_load_balance for these families (models/common/moe.py ``balanced``): the
router runs as it is (gpt-oss: softmax over its top-k logits; GLM: group-limited sigmoid choice, renormalised and
scaled; Qwen3.5: softmax top-k, renormalised) and its gating weights are kept, while the expert ids are replaced by a
round-robin choice, every expert the same load; the router gets gradients through its weights.
--lora: peft's adapters of the workloads' LoRA (bench/workloads.py LORA), exactly the engine's targets: q/k/v/o_proj
(Qwen3.5: of its full-attention layers only; its DeltaNet projections are other names) as target_modules, every
routed expert through target_parameters mlp.experts.gate_up_proj / down_proj; no shared expert, dense MLP or router.

Statistics over --window (0-based steps, inclusive; default the engine's for --steps); MFU with the engine's N
(config.active_params()) over the dense bf16 peak of config/hardware.yaml. Prints one `RESULT {json}` line.

Usage: python bench/hf_families.py --model gpt-oss-20b --layers 4 --row-tokens 4096 --out hf.json [--balanced]
       [--no-recompute] [--lora] [--overrides '{"num_hidden_layers": 4, ...}']
       python bench/hf_families.py --model glm-4.5-air --tiny --device cpu --steps 3 --out tiny.json   (CPU plumbing)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from openrecipes.models.registry import get_config  # noqa: E402
from openrecipes.models.resolve import resolve_model_config  # noqa: E402
from peer_harness import (emit, gpu_peak_flops, hf_rope_fields, loads, lora_fields, memory_fields,  # noqa: E402
                          prepare_and_train, round_robin_router, summarize)
from workloads import default_window, family_of  # noqa: E402

TINY_ROW_TOKENS = 128


@dataclass(frozen=True)
class Family:
    """What the harness needs of a family: transformers' module, config and causal LM classes, its router class,
    our config's expert-count field, the attention implementation, and the registered tiny config."""

    module: str
    config_class: str
    model_class: str
    router: str
    experts_field: str
    attention: str
    tiny: str


FAMILIES = {
    "gpt_oss": Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM", "GptOssTopKRouter", "num_local_experts",
                      "eager", "gpt-oss-tiny"),
    "glm4_moe": Family("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", "Glm4MoeTopkRouter", "n_routed_experts",
                       "sdpa", "glm4-moe-tiny"),
    "qwen3_5_moe": Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTopKRouter",
                          "num_experts", "sdpa", "qwen3.5-moe-tiny"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help=f"a registered model of {', '.join(FAMILIES)}")
    parser.add_argument("--overrides", default=None, help="the engine's model_overrides, a JSON object")
    parser.add_argument("--layers", type=int, default=8, help="the depth, where --overrides does not give one")
    parser.add_argument("--tiny-model", default=None, help="what --tiny trains (default the family's tiny config)")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--row-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--window", default=None, help="FIRST,LAST (0-based steps); default the engine's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "eager"])
    parser.add_argument("--attn", default=None, help="transformers' attn_implementation (default the family's)")
    parser.add_argument("--balanced", action="store_true", help="force round-robin expert choice (exact balance)")
    parser.add_argument("--no-recompute", action="store_true", help="no gradient checkpointing")
    parser.add_argument("--lora", action="store_true",
                        help="train peft adapters of the LoRA workloads (bench/workloads.py LORA) on a frozen base")
    parser.add_argument("--tiny", action="store_true", help="the family's tiny registered config, 128-token rows")
    args = parser.parse_args(argv)
    args.family = family_of(args.model)
    if args.family not in FAMILIES:  # None: not a registered name
        parser.error(f"{args.model} is a {args.family} model; this harness trains {', '.join(FAMILIES)}")
    if args.tiny and args.tiny_model is None:
        args.tiny_model = FAMILIES[args.family].tiny
    if args.tiny and family_of(args.tiny_model) != args.family:
        parser.error(f"--tiny-model {args.tiny_model} is not a {args.family} model")
    return args


def model_overrides(model: str, layers: int, overrides: str | None) -> dict:
    """The engine's model_overrides: the JSON given, else the depth (with the registered layer_types cut to it)."""
    if overrides:
        return json.loads(overrides)
    registered = get_config(model)
    cut = {"layer_types": list(registered.layer_types[:layers])} if hasattr(registered, "layer_types") else {}
    return {"num_hidden_layers": layers, **cut}


def model_config(args: argparse.Namespace):
    """The openrecipes config the engine trains (tiny: the tiny model as registered)."""
    if args.tiny:
        return resolve_model_config(args.tiny_model, overrides={})
    return resolve_model_config(args.model, overrides=model_overrides(args.model, args.layers, args.overrides))


def modeling(family: Family):
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


def build_model(family: Family, config, device: torch.device, attn: str, experts: str):
    """transformers' causal LM of ``config`` (our config's to_hf_dict), random bf16 weights on ``device``."""
    import transformers

    hf_config = getattr(transformers, family.config_class)(**hf_rope_fields(config.to_hf_dict()))
    with device:
        model = getattr(transformers, family.model_class)._from_config(
            hf_config, dtype=torch.bfloat16, attn_implementation=attn, experts_implementation=experts)
    return model.to(device)


def linear_attention_path(family: Family) -> dict:
    """Qwen3.5's Gated DeltaNet: which implementation transformers' decorators bound (the installed fla and
    causal-conv1d packages, else its torch fallbacks)."""
    if family.module != "qwen3_5_moe":
        return {}
    fla = importlib.util.find_spec("fla") is not None
    conv = importlib.util.find_spec("causal_conv1d") is not None
    return {"linear_attention": "flash-linear-attention (fla) chunk_gated_delta_rule" if fla else
            "transformers' torch fallback (torch_chunk_gated_delta_rule)",
            "causal_conv1d": "causal-conv1d package" if conv else "torch fallback (conv1d)"}


def variant_name(args: argparse.Namespace) -> str:
    return f"hf_{args.family}" + ("_bal" if args.balanced else "_nat") + ("_none" if args.no_recompute else "") + \
        ("_lora" if args.lora else "")


def run(args: argparse.Namespace) -> dict:
    family = FAMILIES[args.family]
    device = torch.device(args.device)
    config = model_config(args)
    tokens = TINY_ROW_TOKENS if args.tiny else args.row_tokens
    window = tuple(int(s) for s in args.window.split(",")) if args.window else default_window(args.steps)
    patched = round_robin_router(getattr(modeling(family), family.router)) if args.balanced else None
    torch.manual_seed(0)
    started = time.perf_counter()
    model = build_model(family, config, device, args.attn or family.attention, args.experts)
    build_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    if params != config.total_params():
        print(f"[hf_families] warning: {params:,} parameters, the engine's model has {config.total_params():,}",
              flush=True)
    hf_model, experts = model, getattr(config, family.experts_field)
    model, probe, times, losses = prepare_and_train(
        model, experts=experts, recompute=not args.no_recompute, lora=args.lora, steps=args.steps, tokens=tokens,
        vocab=config.vocab_size, device=device, probe_step=min(args.steps - 1, window[1] + 1), tag=f"hf_{args.family}")
    return result(args, family, config, hf_model, model, dict(
        params=params, tokens=tokens, window=window, patched=patched, build_s=build_s, times=times, losses=losses,
        loads=loads(probe, tokens, config.num_experts_per_tok, experts)))


def result(args: argparse.Namespace, family: Family, config, hf_model, model, run: dict) -> dict:
    """The result record: what ran (model, depth, implementations, routing, recipe) and what it measured."""
    import transformers

    device = torch.device(args.device)
    return {
        "variant": variant_name(args), "family": args.family, "hf_class": family.model_class,
        "framework": f"transformers {transformers.__version__}", "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "model": args.tiny_model if args.tiny else args.model,
        "overrides": {} if args.tiny else model_overrides(args.model, args.layers, args.overrides),
        "layers": config.num_hidden_layers, "experts": getattr(config, family.experts_field),
        "row_tokens": run["tokens"], "rows_per_step": 1, "steps": args.steps, "total_params": run["params"],
        "same_params_as_engine": run["params"] == config.total_params(),
        "param_dtypes": sorted({str(p.dtype) for p in hf_model.parameters()}),
        "attn_implementation": hf_model.config._attn_implementation,
        "experts_implementation": getattr(hf_model.config, "_experts_implementation", None),
        **({"sliding_window": config.sliding_window} if args.family == "gpt_oss" else {}),
        **linear_attention_path(family),
        "routing": f"forced round-robin ({run['patched']})" if run["patched"] else "natural (random init)",
        "grad_ckpt": not args.no_recompute, "compile": False,
        "precision": "pure bf16 params/grads/AdamW states", "build_s": run["build_s"],
        "optimizer": f"torch.optim.AdamW(fused={device.type == 'cuda'})",
        **(lora_fields(model, device) if args.lora else {}),
        **run["loads"], "step_times_s": run["times"], "losses": run["losses"],
        **summarize(run["times"], run["tokens"], run["window"], config.active_params(), gpu_peak_flops(device)),
        **memory_fields(device),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
