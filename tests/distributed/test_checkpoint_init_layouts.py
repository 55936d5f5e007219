"""Training from a Hugging Face checkpoint under a parallel layout keeps the fp32-pinned tensors fp32 (the loop checks
every rank's model before the first step) and trains as one process does."""

import json

import pytest

from openrecipes.checkpoint.hf import save_hf
from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.registry import get_config
from tests.distributed.test_layouts import metrics, train


@pytest.mark.slow
def test_init_from_checkpoint_under_dp2_ep2_keeps_fp32_and_matches_one_process(tmp_path):
    source = build_muse_spark(get_config("muse-spark-tiny"), seed=7)
    save_hf(source, tmp_path / "hf")
    # bf16 parameters (the precision-aware optimizer keeps them bf16 under FSDP2) with fp32 router, bias and gates
    sets = (f"model={tmp_path / 'hf'}", "init=checkpoint", "precision=bf16", "optimizer.precision_aware=true",
            "optimizer.moment_dtype=fp32")
    single = train(tmp_path / "single", *sets)
    assert single.returncode == 0, single.stderr[-3000:]
    parallel = train(tmp_path / "parallel", *sets, "layout.dp=2", "layout.ep=2", nproc=2)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "parallel")
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(two, one):  # bf16: the layouts sum in another order
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2), a["step"]
    assert json.loads((tmp_path / "parallel" / "run.json").read_text())["world_size"] == 2
