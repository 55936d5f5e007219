"""What the transformers peers (bench/hf_qwen3_moe.py, bench/hf_deepseek_v3.py, bench/hf_families.py) share: the
reference training step (pure bf16, fused AdamW, the model's shifted LM loss, no clipping, no compile), its timing,
the window's statistics, gradient checkpointing, the load probe, forced balance, peft's LoRA of the workloads'
adapters, the MFU peak and the result's output. One copy, so every peer trains and times alike."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from workloads import LORA


def enable_recompute(model) -> None:
    """Gradient checkpointing of every decoder layer, non-reentrant (transformers' default)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name; gradient_checkpointing_enable warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

def hf_rope_fields(fields: dict) -> dict:
    """transformers 5.x's own spelling of the RoPE: the legacy rope_scaling + rope_theta pair of a config dict as
    rope_parameters (a dict already in that spelling is returned as it is); no KV cache (training)."""
    fields = {**fields, "use_cache": False}
    if "rope_theta" in fields:
        fields["rope_parameters"] = {**(fields.pop("rope_scaling", None) or {"rope_type": "default"}),
                                     "rope_theta": fields.pop("rope_theta")}
    return fields


def load_probe(model, experts: int):
    """Per MoE layer, tokens per expert of one armed forward: a pre-hook on the experts module reads the indices it
    is handed (the same call in every 5.x layout: Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss and Qwen3.5 alike).
    Recomputed forwards are ignored (only the first call per layer counts)."""
    probe = {"armed": False, "counts": {}}

    def hook(module, args, kwargs):
        if probe["armed"] and module not in probe["counts"]:
            indices = args[1] if len(args) > 1 else kwargs["top_k_index"]
            probe["counts"][module] = torch.bincount(indices.reshape(-1), minlength=experts).float().cpu()

    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):  # dense layers' MLPs have none
            layer.mlp.experts.register_forward_pre_hook(hook, with_kwargs=True)
    return probe


def round_robin_router(router_cls) -> str:
    """Patch ``router_cls.forward`` (transformers 5.x: it returns logits, gating weights and expert ids) to keep its
    logits and gating weights and replace the ids by a round-robin choice: slot s of the tokens' T*K choices gets
    expert s mod E, every expert the same load. This is the engine's debug.force_load_balance (models/common/moe.py
    ``balanced``): the router's own computation runs, so it still gets gradients."""
    natural = router_cls.forward

    def forward(self, hidden_states):
        logits, weights, indices = natural(self, hidden_states)
        slots = torch.arange(indices.numel(), device=indices.device)
        return logits, weights, (slots % logits.shape[-1]).view(indices.shape)

    router_cls.forward = forward
    return f"{router_cls.__name__}.forward, its gating weights kept"


def loads(probe: dict, tokens: int, top_k: int, experts: int) -> dict:
    """Each probed MoE layer's largest and smallest expert load over the mean."""
    mean_load = tokens * top_k / experts
    ratios = [c / mean_load for c in probe["counts"].values()]
    return {"load_max_over_mean": [round(c.max().item(), 3) for c in ratios],
            "load_min_over_mean": [round(c.min().item(), 3) for c in ratios]}


def peft_lora_config():
    """The LoRA workloads' adapters (workloads.LORA) as peft's config: the attention projections as modules, the
    routed experts as their fused weights, which transformers 5.x keeps as 3-D parameters mlp.experts.gate_up_proj
    and mlp.experts.down_proj (Qwen3-MoE, GLM-4.5, Qwen3.5: (E, 2F, D) and (E, D, F); gpt-oss transposed)."""
    import peft

    modules = [t for t in LORA["targets"] if t != "experts"]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if "experts" in LORA["targets"] else None
    return peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                           target_modules=modules, target_parameters=experts)


def add_lora(model):
    """``model`` under peft's adapters; peft freezes every base parameter."""
    import peft

    return peft.get_peft_model(model, peft_lora_config())


def lora_fields(model, device: torch.device) -> dict:
    """What the result records of the adapters (their settings, count and dtypes), over the full model's fields."""
    import peft
    import transformers

    trained = [p for p in model.parameters() if p.requires_grad]
    dtypes = ", ".join(sorted({str(p.dtype) for p in trained}))
    return {"framework": f"transformers {transformers.__version__} + peft {peft.__version__}", "lora": dict(LORA),
            "trainable_params": sum(p.numel() for p in trained), "adapter_dtypes": dtypes,
            "precision": f"frozen bf16 base; adapters, their grads and AdamW states {dtypes}",
            "optimizer": f"torch.optim.AdamW(fused={device.type == 'cuda'}) over the adapters only"}


def prepare_and_train(model, *, experts: int, recompute: bool, lora: bool, steps: int, tokens: int, vocab: int,
                      device: torch.device, probe_step: int, tag: str):
    """A built transformers model as its user trains it: gradient checkpointing before peft wraps it (as peft's guides
    do), the load probe on the experts modules peft's wrappers still call, the adapters, then ``train``. Returns the
    trained model (peft's with ``lora``), the probe, and the step times and losses."""
    if recompute:
        enable_recompute(model)
    probe = load_probe(model, experts)
    if lora:
        model = add_lora(model)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = train(model, steps=steps, tokens=tokens, vocab=vocab, device=device, probe=probe,
                          probe_step=probe_step, tag=tag)
    return model, probe, times, losses


def train(model, *, steps: int, tokens: int, vocab: int, device: torch.device, probe: dict, probe_step: int,
          tag: str):
    """``steps`` steps of one random row of ``tokens`` ids; each step's time synchronised on CUDA. ``probe["armed"]``
    is true during step ``probe_step`` only (outside the window: a load probe's host syncs do not count)."""
    # over what trains: every parameter, or a LoRA run's adapters (its frozen base keeps no optimizer state)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(1234)
    times, losses = [], []
    for step in range(steps):
        ids = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)
        probe["armed"] = step == probe_step
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        probe["armed"] = False
        losses.append(loss.item())
        print(f"[{tag}] step {step:2d} {times[-1] * 1e3:9.1f} ms {tokens / times[-1]:9.0f} tok/s "
              f"loss {losses[-1]:.4f}", flush=True)
    return times, losses


def summarize(times: list[float], tokens: int, window: tuple[int, int], active_params: int,
              peak_flops: float | None) -> dict:
    """Statistics over ``window`` (0-based steps, inclusive), cut to the steps run (a short CPU run summarises its
    last step); ``tokens_per_s_window`` is the window's tokens over its time, as `openrecipes measure` reports."""
    last = min(window[1], len(times) - 1)
    first = min(window[0], last)
    kept = times[first:last + 1]
    rates = [tokens / t for t in kept]
    out = {"window": [first, last], "window_steps": len(kept),
           "step_time_median_s": statistics.median(kept), "step_time_mean_s": statistics.mean(kept),
           "tokens_per_s_median": statistics.median(rates), "tokens_per_s_mean": statistics.mean(rates),
           "tokens_per_s_window": tokens * len(kept) / sum(kept),
           "step_time_cv": statistics.pstdev(kept) / statistics.mean(kept), "active_params_N": active_params}
    if peak_flops:
        out["peak_flops"] = peak_flops
        for key in ("median", "mean", "window"):
            out[f"mfu_{key}"] = 6 * active_params * out[f"tokens_per_s_{key}"] / peak_flops
    return out


def gpu_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of config/hardware.yaml for an H100 or H200 (the engine's MFU uses the same)."""
    if device.type != "cuda":
        return None
    from openrecipes.config.hardware import load_hardware

    name = torch.cuda.get_device_name(device)
    part = next((p for p in ("H200", "H100") if p in name), None)  # the same 989 TFLOP/s datasheet figure
    return load_hardware().gpu(part).peak_bf16_dense_flops if part else None


def memory_fields(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return dict(peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
                alloc_retries=torch.cuda.memory_stats(device).get("num_alloc_retries"))


def emit(result: dict, out: str | None) -> None:
    """One ``RESULT {json}`` line on stdout, and the JSON in ``out``."""
    print("RESULT " + json.dumps(result, default=str), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2, default=str) + "\n")
