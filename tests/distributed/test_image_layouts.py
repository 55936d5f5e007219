"""Image-text SFT with data parallelism against one process: fp32, gloo, two processes. FSDP2 shards the frozen
vision tower with everything else (each rank gathers it for its own images); losses and gradient norms equal one
process's. The layouts image rows do not run yet are refused before any step (tests/train/test_image_training.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_layouts import assert_same, metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-vl-moe-sft.yaml"
COMMON = ["steps=3", "logging.progress=false", "checkpoint.every=null", "checkpoint.at_end=false",
          "data.build.rows=12"]


def _train(run_dir, nproc):
    args = [sys.executable, "-m", "openrecipes", "train", str(EXAMPLE), "--nproc", str(nproc)]
    for item in (*COMMON, f"run_dir={run_dir}"):
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics(run_dir)


@pytest.mark.slow
def test_image_rows_dp2_match_one_process(tmp_path):
    assert_same(_train(tmp_path / "dp2", 2), _train(tmp_path / "one", 1))
