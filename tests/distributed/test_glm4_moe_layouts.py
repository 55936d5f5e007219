"""GLM-4.5-MoE (dense first layer, GQA with biases and qk-norm, partial RoPE, grouped routing, shared experts) under
DP2-EP2 against one process: fp32, the tiny model, gloo on CPU."""

from pathlib import Path

from tests.distributed.test_layouts import assert_same, metrics, train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-glm4-moe-sft.yaml"


def test_glm4_moe_dp2_ep2_matches_one_process(tmp_path):
    single = train(tmp_path / "single", example=EXAMPLE)
    assert single.returncode == 0, single.stderr[-3000:]
    # expert parallelism splits the routed experts of the MoE layers only; the dense first layer and the shared
    # experts stay whole on both ranks
    parallel = train(tmp_path / "parallel", "layout.dp=2", "layout.ep=2", nproc=2, example=EXAMPLE)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    assert_same(metrics(tmp_path / "parallel"), metrics(tmp_path / "single"))
