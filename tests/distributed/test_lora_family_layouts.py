"""LoRA on GLM-4.5-MoE, Qwen3.5-MoE (DP2-EP2) and gpt-oss (DP2, the layout it runs) against one process: fp32,
gloo, attention (Qwen3.5-MoE: both mixers) and expert adapters. Losses and gradient norms equal one process's, and so
does the saved PEFT adapter, up to the few entries whose Adam update rests on a near-zero gradient, where another
summation order moves them (measured: 5e-6 at most, over 3 steps)."""

from pathlib import Path

import pytest
import torch

from tests.distributed.test_layouts import assert_same, train_metrics
from tests.distributed.test_lora_layouts import COMMON, _adapter

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FP32 = [*COMMON, "precision=fp32", "optimizer.precision_aware=false"]
CASES = {
    "glm4-moe": ("[q_proj, k_proj, v_proj, o_proj, experts]", ["layout.dp=2", "layout.ep=2"]),
    "qwen3-5-moe": ("[q_proj, o_proj, in_proj_qkv, in_proj_z, out_proj, experts]", ["layout.dp=2", "layout.ep=2"]),
    "gpt-oss": ("[q_proj, k_proj, v_proj, o_proj, experts]", ["layout.dp=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CASES))
def test_lora_layout_matches_one_process(tmp_path, family):
    targets, layout = CASES[family]
    sets = [f"lora={{rank: 4, alpha: 8, targets: {targets}}}"]
    example = EXAMPLES / f"tiny-{family}-sft.yaml"
    one = train_metrics(tmp_path / "one", *sets, example=example, common=FP32)
    assert_same(train_metrics(tmp_path / "two", *sets, *layout, nproc=2, example=example, common=FP32), one)
    reference, adapter = _adapter(tmp_path / "one"), _adapter(tmp_path / "two")
    assert adapter.keys() == reference.keys()
    assert any("experts" in key for key in reference)
    assert all(value.abs().max() > 0 for key, value in reference.items() if "lora_B" in key)  # every adapter trained
    for key in reference:
        torch.testing.assert_close(adapter[key], reference[key], rtol=1e-5, atol=1e-5, msg=key)
