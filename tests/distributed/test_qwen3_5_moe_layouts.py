"""Qwen3.5-MoE (gated DeltaNet and gated full attention layers, routed experts plus a gated shared expert) under
DP2-EP2 against one process: fp32, the tiny model, gloo on CPU."""

from pathlib import Path

from tests.distributed.test_layouts import assert_same, metrics, train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-5-moe-sft.yaml"


def test_qwen3_5_moe_dp2_ep2_matches_one_process(tmp_path):
    single = train(tmp_path / "single", example=EXAMPLE)
    assert single.returncode == 0, single.stderr[-3000:]
    # expert parallelism splits the routed experts; the shared expert, its gate and the linear attention stay whole
    parallel = train(tmp_path / "parallel", "layout.dp=2", "layout.ep=2", nproc=2, example=EXAMPLE)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    assert_same(metrics(tmp_path / "parallel"), metrics(tmp_path / "single"))
