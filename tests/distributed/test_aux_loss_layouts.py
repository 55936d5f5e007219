"""The router load-balancing loss under data and expert parallelism equals one process's (fp32, gloo, CPU)."""

import pytest

from tests.distributed.test_layouts import assert_same, metrics, train

AUX = "moe.aux_loss_coef=0.1"


def test_dp2_ep2_aux_loss_matches_one_process(tmp_path):
    single = train(tmp_path / "single", AUX)
    assert single.returncode == 0, single.stderr[-3000:]
    parallel = train(tmp_path / "parallel", AUX, "layout.dp=2", "layout.ep=2", nproc=2)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    reference, candidate = metrics(tmp_path / "single"), metrics(tmp_path / "parallel")
    assert_same(candidate, reference)
    for c, r in zip(candidate, reference):
        assert c["aux_loss"] == pytest.approx(r["aux_loss"], rel=1e-5)


def test_pipeline_with_aux_loss_is_a_clear_error(tmp_path):
    result = train(tmp_path / "run", AUX, "layout.dp=1", "layout.pp=2", nproc=2)
    assert result.returncode != 0
    assert "moe.aux_loss_coef=0.1 is not supported with layout.pp=2" in result.stderr
