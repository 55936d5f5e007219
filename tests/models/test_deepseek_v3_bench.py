"""The DeepSeek-V3 throughput comparison's two sides (bench/deepseek_v3_workload.py): the workload builds the same
model in transformers and in openrecipes (every tensor's name and shape, on the meta device), and the transformers
harness (bench/hf_deepseek_v3.py) trains it end to end on the CPU at tiny widths and writes its result."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openrecipes.models.deepseek_v3 import DeepseekV3ForCausalLM

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load_workload():
    # from its file, leaving bench/ off sys.path (its modules' names are not a package's)
    spec = importlib.util.spec_from_file_location("deepseek_v3_workload", BENCH / "deepseek_v3_workload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workload = _load_workload()


def _shapes_as_transformers_names(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The native model's trainable tensors under transformers' layout: the routed experts' gate and up projections
    fused into one (E, 2F, D) tensor (transformers' gate_up_proj); the routers' frozen correction biases (buffers in
    transformers) left out."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    for name in [n for n in shapes if n.endswith("experts.gate_proj")]:
        experts, ffn, hidden = shapes.pop(name)
        assert shapes.pop(name.replace("gate_proj", "up_proj")) == (experts, ffn, hidden)
        shapes[name.replace("gate_proj", "gate_up_proj")] = (experts, 2 * ffn, hidden)
    return shapes


@pytest.mark.parametrize("tiny", [False, True], ids=["real_widths", "tiny"])
def test_the_workload_builds_the_same_model_in_transformers_and_openrecipes(tiny):
    config = workload.model_config(tiny)
    with torch.device("meta"):
        native = DeepseekV3ForCausalLM(config)
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**workload.hf_config_fields(tiny)))
    hf_shapes = {name: tuple(p.shape) for name, p in hf.named_parameters()}
    assert _shapes_as_transformers_names(native) == hf_shapes
    hf_params = sum(p.numel() for p in hf.parameters())
    assert hf_params == sum(p.numel() for p in native.parameters() if p.requires_grad) == config.total_params()
    biases = {name: tuple(b.shape) for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias")}
    assert biases == {name: tuple(p.shape) for name, p in native.named_parameters() if not p.requires_grad}
    # the same attention: YaRN's frequencies, cos/sin factor and softmax correction as transformers computes them
    assert math.isclose(hf.model.layers[0].self_attn.scaling, config.softmax_scale, rel_tol=1e-12)
    rotary = DeepseekV3RotaryEmbedding(hf.config)  # on the CPU: its frequencies are computed at construction
    native_freq = config.rope_scaling.inv_freq(config.qk_rope_head_dim, config.rope_theta)
    torch.testing.assert_close(rotary.inv_freq.float(), native_freq.float(), rtol=1e-6, atol=0)
    assert math.isclose(rotary.attention_scaling, config.rope_scaling.cos_sin_factor, rel_tol=1e-12)
    if not tiny:
        assert hf_params == 6_301_744_128
        assert hf.config.rope_parameters["rope_type"] == "yarn" and hf.config.rope_parameters["factor"] == 40.0
        widths = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048,
                      intermediate_size=18432, vocab_size=129280, n_shared_experts=1, num_experts_per_tok=8,
                      routed_scaling_factor=2.5)
        assert {key: getattr(hf.config, key) for key in widths} == widths
        assert [hasattr(layer.mlp, "gate") for layer in hf.model.layers] == [False, True, True, True]


@pytest.mark.parametrize("flags", [["--balanced"], ["--no-recompute"]], ids=["balanced", "no_recompute"])
def test_transformers_harness_trains_the_tiny_workload_on_cpu(flags, tmp_path):
    out = tmp_path / "hf.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(BENCH / "hf_deepseek_v3.py"), "--tiny", "--device", "cpu",
                           "--steps", "3", "--out", str(out), *flags],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    printed = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(printed) == 1 and json.loads(printed[0][len("RESULT "):])["step_times_s"] == result["step_times_s"]

    config = workload.model_config(tiny=True)
    balanced = "--balanced" in flags
    assert result["variant"] == "hf_dsv3_" + ("bal" if balanced else "nat_none")
    assert result["model"] == workload.TINY_MODEL and result["row_tokens"] == workload.TINY_ROW_TOKENS
    assert result["total_params"] == config.total_params() and result["same_params_as_engine"] is True
    assert result["active_params_N"] == config.active_params()
    assert result["grad_ckpt"] is not ("--no-recompute" in flags) and result["compile"] is False
    assert result["attn_implementation"] == "sdpa"
    assert result["experts_implementation"] == "grouped_mm" and result["experts_note"] is None
    assert "torch.bfloat16" in result["param_dtypes"]
    assert len(result["step_times_s"]) == len(result["losses"]) == 3
    assert all(math.isfinite(loss) and loss > 0 for loss in result["losses"])
    assert result["window"] == [2, 2] and result["window_steps"] == 1  # the workload's window cut to 3 steps
    for key in ("tokens_per_s_median", "tokens_per_s_mean", "tokens_per_s_window", "step_time_median_s"):
        assert result[key] > 0, key
    assert "mfu_median" not in result and "peak_memory_gib" not in result  # GPU-only figures
    moe_layers = config.num_moe_layers
    assert len(result["load_max_over_mean"]) == len(result["load_min_over_mean"]) == moe_layers
    if balanced:  # 128 tokens x top-2 over 8 experts: round-robin gives each exactly 32
        assert result["routing"].startswith("forced round-robin")
        assert result["load_max_over_mean"] == result["load_min_over_mean"] == [1.0] * moe_layers
    else:
        assert result["routing"].startswith("natural")
