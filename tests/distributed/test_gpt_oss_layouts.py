"""gpt-oss under data parallelism against one process (fp32, the tiny model, gloo on CPU), and the layouts it
refuses by name: expert parallelism (biased, clamped experts its dispatcher does not run), tensor parallelism (the
row-parallel o_proj's bias, and the sinks, which are per head and not split)."""

from pathlib import Path

import pytest

from tests.distributed.test_layouts import assert_same, metrics, train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-gpt-oss-sft.yaml"


def test_gpt_oss_dp2_matches_one_process(tmp_path):
    single = train(tmp_path / "single", example=EXAMPLE)
    assert single.returncode == 0, single.stderr[-3000:]
    parallel = train(tmp_path / "parallel", "layout.dp=2", nproc=2, example=EXAMPLE)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    assert_same(metrics(tmp_path / "parallel"), metrics(tmp_path / "single"))


@pytest.mark.parametrize("layout, message", [
    (("layout.ep=2",), "layout.ep: gpt-oss's experts run on one process"),
    # the family's declaration (the model itself refuses too: the biased o_proj first, test_gpt_oss_model.py)
    (("layout.tp=2", "layout.sequence_parallel=true"), "layout.tp: gpt-oss's attention does not split"),
])
def test_unsupported_layouts_are_refused_by_name(tmp_path, layout, message):
    """Before any process starts: one line naming the key, exit 2, no run directory."""
    result = train(tmp_path / "run", *layout, "steps=1", nproc=2, example=EXAMPLE)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
