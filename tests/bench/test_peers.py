"""The transformers Qwen3-MoE peer (bench/hf_qwen3_moe.py): it builds the engine's model (same tensors at real
widths, on the meta device) and trains the tiny one on the CPU with forced balance, writing its result."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from .conftest import BENCH, load_bench

transformers = pytest.importorskip("transformers")
peer = load_bench("hf_qwen3_moe")


def test_the_peer_builds_the_engine_model_at_real_widths():
    config = peer.model_config(layers=8, tiny=False)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**peer.hf_config_fields(config)))
    assert sum(p.numel() for p in hf.parameters()) == config.total_params() == 5_607_297_024
    assert len(hf.model.layers) == 8 and hf.config.num_experts == 128 and hf.config.hidden_size == 2048


@pytest.mark.parametrize("flags", [["--balanced"], ["--no-recompute"]], ids=["balanced", "no_recompute"])
def test_the_peer_trains_the_tiny_model_on_cpu(flags, tmp_path):
    out = tmp_path / "hf.json"
    done = subprocess.run([sys.executable, str(BENCH / "hf_qwen3_moe.py"), "--tiny", "--device", "cpu", "--steps", "4",
                           "--window", "1,2", "--out", str(out), *flags],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    config = peer.model_config(layers=8, tiny=True)
    balanced = "--balanced" in flags
    assert result["variant"] == "hf_qwen3_" + ("bal" if balanced else "nat_none")
    assert result["total_params"] == config.total_params() and result["same_params_as_engine"] is True
    assert result["active_params_N"] == config.active_params()
    assert result["grad_ckpt"] is balanced and result["attn_implementation"] == "sdpa"
    assert result["experts_implementation"] == "grouped_mm" and result["param_dtypes"] == ["torch.bfloat16"]
    assert len(result["step_times_s"]) == 4 and all(math.isfinite(x) and x > 0 for x in result["losses"])
    assert result["window"] == [1, 2] and result["window_steps"] == 2
    rates = [peer.TINY_ROW_TOKENS / t for t in result["step_times_s"][1:3]]
    assert math.isclose(result["tokens_per_s_mean"], sum(rates) / 2, rel_tol=1e-9)
    assert len(result["load_max_over_mean"]) == config.num_hidden_layers
    if balanced:  # 128 tokens x top-2 over 8 experts, round-robin: 32 each
        assert result["load_max_over_mean"] == result["load_min_over_mean"] == [1.0] * config.num_hidden_layers
    else:
        assert result["routing"].startswith("natural")
