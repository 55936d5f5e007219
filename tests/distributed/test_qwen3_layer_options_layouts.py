"""Qwen3-MoE with a dense layer (mlp_only_layers) and a sliding window under two-process layouts against one
process: fp32, the tiny model, gloo on CPU. The window (16 tokens) is shorter than the bundled rows' documents, so
it changes the attention of every layout, the context-parallel slices included."""

import pytest

from tests.distributed.test_layouts import assert_same, metrics, train

OPTIONS = "model_overrides={mlp_only_layers: [0], sliding_window: 16}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    result = train(run_dir, OPTIONS)
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics(run_dir)


def test_the_options_change_the_run(tmp_path, reference):
    # without them the losses differ: the layouts below are held to a run that computes both options
    plain = train(tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert metrics(tmp_path / "plain")[0]["loss"] != pytest.approx(reference[0]["loss"], rel=1e-4)


@pytest.mark.parametrize("sets", [
    ("layout.dp=2", "layout.ep=2"),
    ("layout.dp=1", "layout.tp=2", "layout.sequence_parallel=true"),
    ("layout.dp=1", "layout.cp=2"),
    ("layout.dp=1", "layout.pp=2", "layout.max_tokens_per_gpu=256"),
], ids=["DP2-EP2", "TP2-SP", "CP2", "PP2"])
def test_layout_matches_one_process(tmp_path, reference, sets):
    result = train(tmp_path / "run", OPTIONS, *sets, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same(metrics(tmp_path / "run"), reference)
