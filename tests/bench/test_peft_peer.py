"""The transformers + peft LoRA peer (bench/hf_qwen3_moe.py --lora): it trains exactly the adapters the engine's LoRA
workloads train (counted by the engine's own apply_lora, at real widths and tiny), leaves its bf16 base unchanged,
and writes the result the runner and the report read."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from .conftest import BENCH, load_bench

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
peer = load_bench("hf_qwen3_moe")
harness = load_bench("peer_harness")
workloads = load_bench("workloads")


def engine_adapter_count(config, device: str) -> int:
    """What the engine trains under the workloads' LoRA: its model, adapted by its apply_lora."""
    from openrecipes.models.common.lora import LoraSpec, apply_lora
    from openrecipes.models.qwen3_moe.model import build_qwen3_moe

    lora = workloads.LORA
    spec = LoraSpec(rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"], targets=tuple(lora["targets"]))
    model = build_qwen3_moe(config, device=device, dtype=torch.bfloat16, seed=None if device == "meta" else 0)
    apply_lora(model, spec)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def test_the_peer_adapts_what_the_engine_adapts_at_real_widths():
    config = peer.model_config(layers=8, tiny=False)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**peer.hf_config_fields(config)))
    hf = harness.add_lora(hf)
    count = sum(p.numel() for p in trainable(hf).values())
    assert count == engine_adapter_count(config, "meta") == 107_085_824


def test_the_peer_trains_only_the_adapters_through_recompute_and_keeps_the_base(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = peer.model_config(layers=8, tiny=True)
    torch.manual_seed(0)
    model = peer.build_model(peer.hf_config_fields(config), torch.device("cpu"), "grouped_mm")
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    harness.enable_recompute(model)
    model = harness.add_lora(model)
    adapters = trainable(model)
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert sum(p.numel() for p in adapters.values()) == engine_adapter_count(config, "cpu")
    experts = [n for n in adapters if ".mlp.experts." in n]
    assert len(experts) == 4 * config.num_hidden_layers  # A and B of gate_up_proj and down_proj in every layer
    harness.train(model, steps=3, tokens=32, vocab=config.vocab_size, device=torch.device("cpu"),
                  probe={"armed": False, "counts": {}}, probe_step=-1, tag="test")
    # B starts at zero: every B has moved, so gradients reached every layer's adapters through the recomputed layers
    assert all(p.abs().sum() > 0 for name, p in adapters.items() if ".lora_B." in name)
    frozen = {name.replace("base_model.model.", "").replace(".base_layer", ""): p
              for name, p in model.named_parameters() if not p.requires_grad}
    assert set(frozen) == set(base)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, base[name]) for name, p in frozen.items())


def test_the_peer_writes_the_result_the_runner_reads(tmp_path):
    out = tmp_path / "peft.json"
    done = subprocess.run([sys.executable, str(BENCH / "hf_qwen3_moe.py"), "--tiny", "--device", "cpu", "--steps", "4",
                           "--window", "1,2", "--lora", "--balanced", "--no-recompute", "--out", str(out)],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    config = peer.model_config(layers=8, tiny=True)
    assert result["variant"] == "hf_qwen3_bal_none_lora" and "+ peft " in result["framework"]
    assert result["lora"] == workloads.LORA and result["trainable_params"] == engine_adapter_count(config, "cpu")
    assert result["total_params"] == config.total_params() and result["param_dtypes"] == ["torch.bfloat16"]
    assert result["grad_ckpt"] is False and result["routing"].startswith("forced")
    assert result["load_max_over_mean"] == result["load_min_over_mean"] == [1.0] * config.num_hidden_layers
    assert result["window"] == [1, 2] and result["window_steps"] == 2 and len(result["step_times_s"]) == 4
    assert result["tokens_per_s_window"] > 0 and all(math.isfinite(x) for x in result["losses"])
