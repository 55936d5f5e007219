"""The DeepSeek-V3 workload trained by both sides of the comparison: the engine (bench/engine_speed.py, dsv3_*
variants) and transformers' DeepseekV3ForCausalLM (bench/hf_deepseek_v3.py). One definition here, so both train the
same model (tests/models/test_deepseek_v3_bench.py builds it in both and compares the parameter counts).

The model: DeepSeek-V3 at its real widths and with its registered YaRN (deepseek-v3-671b: hidden 7168, 128 heads,
q_lora_rank 1536, kv_lora_rank 512, qk nope/rope 128/64, value heads 128, dense MLP 18432, expert FFN 2048, one shared
expert, top-8 with routed_scaling 2.5, vocabulary 129280) at reduced depth and expert count:
  4 layers, the first dense (first_k_dense_replace 1): the dense MLP, MLA and the MoE block all appear, and 3 of the 4
    layers are MoE layers, as 58 of DeepSeek-V3's 61 are.
  24 routed experts in 8 groups of 3, top-4 groups kept (12 candidates for the top-8). A token's work is the full
    model's (8 routed + 1 shared expert of 2048 per MoE layer): the expert count only sets the weights' memory.
    n_group must divide the experts with at least 2 per group (a group scores by its best two); 24 is the largest
    count with DeepSeek-V3's 8 groups that leaves the engine room on an H100 (32 would not, see below).
  one 4,096-token row per step (DeepSeek-V3's pre-training sequence length).

Memory (an estimate, not a measurement): 6,301,744,128 parameters (4 x 187.1 M attention, 396.4 M dense MLP,
3 x (24 + 1) x 44.0 M experts, 2 x 926.7 M embedding and LM head).
  transformers, pure bf16 (params, grads, AdamW m and v: 8 bytes each): 47.0 GiB once every gradient exists; on top
    of that the recomputed layer (~2 GiB) or, without recompute, ~3 GiB of saved activations per layer, and the loss
    over 4,096 x 129,280 logits (bf16 logits, fp32 copies for the cross entropy and its gradient: ~5 GiB, while only
    the LM head's gradient exists). Estimated peak: ~50 GiB with gradient checkpointing, ~56 GiB without.
  the engine (precision-aware Adam: bf16 params + int16 remainders + bf16 moments, bf16 gradients: 10 bytes each):
    58.7 GiB of state; `openrecipes plan`'s memory model (plan/memory.py, one 4,096-token microbatch per step, H100)
    predicts 68.0 GiB with full recompute and 71.9 GiB without. With 32 experts it predicts 78.8 and 80.6 GiB, past
    an H100's 79.6 GiB, hence 24.
Both fit an H100 80 GB and an H200.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from openrecipes.models.resolve import resolve_model_config  # noqa: E402

MODEL = "deepseek-v3-671b"
OVERRIDES = {
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 24,
    "n_group": 8,
    "topk_group": 4,
    # transformers' causal LM forward runs no multi-token-prediction layer; none is built on either side
    "num_nextn_predict_layers": 0,
}
ROW_TOKENS = 4096
STEPS = 25
WINDOW = (5, 19)  # steps, 0-based and inclusive: 15 steps after 5 of warm-up (allocator, kernels' autotuning)

# CPU plumbing runs (tests, `engine_speed.py` without a GPU): the registered tiny DeepSeek-V3 as registered (a dense
# first layer, 8 routed experts in 2 groups, one shared expert, MLA at small widths)
TINY_MODEL = "deepseek-v3-tiny"
TINY_ROW_TOKENS = 128


def model_name(tiny: bool = False) -> str:
    return TINY_MODEL if tiny else MODEL


def overrides(tiny: bool = False) -> dict[str, Any]:
    return {} if tiny else dict(OVERRIDES)


def model_config(tiny: bool = False) -> Any:
    """The openrecipes DeepseekV3Config the engine trains (the registered config with the overrides applied)."""
    return resolve_model_config(model_name(tiny), overrides=overrides(tiny))


def hf_config_fields(tiny: bool = False) -> dict[str, Any]:
    """The same config as transformers' DeepseekV3Config keyword arguments (its config.json fields)."""
    fields = model_config(tiny).to_hf_dict()
    fields["use_cache"] = False  # training: no KV cache
    # transformers 5.x's own spelling of the RoPE (the legacy rope_scaling + rope_theta pair is converted to it)
    fields["rope_parameters"] = {**(fields.pop("rope_scaling") or {"rope_type": "default"}),
                                 "rope_theta": fields.pop("rope_theta")}
    return fields


def _check() -> None:
    # the group-limited router's constraints, stated here too so an edit of the numbers fails at import
    experts, groups, kept = OVERRIDES["n_routed_experts"], OVERRIDES["n_group"], OVERRIDES["topk_group"]
    assert experts % groups == 0 and experts // groups >= 2, (experts, groups)
    assert kept * experts // groups >= 8, "top-8 must fit in the kept groups' experts"
    assert WINDOW[1] < STEPS


_check()
