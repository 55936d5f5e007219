"""DeepSeek-V3 (dense first layer, latent attention, grouped routing, shared experts) under DP2-EP2 against one
process: fp32, the tiny model, gloo on CPU."""

from pathlib import Path

from tests.distributed.test_layouts import assert_same, metrics, train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-deepseek-v3-sft.yaml"


def test_deepseek_v3_dp2_ep2_matches_one_process(tmp_path):
    single = train(tmp_path / "single", example=EXAMPLE)
    assert single.returncode == 0, single.stderr[-3000:]
    # expert parallelism splits the routed experts of the MoE layers only; the dense first layer and the shared
    # experts stay whole on both ranks
    parallel = train(tmp_path / "parallel", "layout.dp=2", "layout.ep=2", nproc=2, example=EXAMPLE)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    assert_same(metrics(tmp_path / "parallel"), metrics(tmp_path / "single"))
