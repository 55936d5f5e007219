"""LoRA under data parallelism (FSDP2 shards the frozen base and the adapters) against one process: fp32, gloo."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_layouts import assert_same, metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-lora.yaml"
COMMON = ["steps=4", "logging.progress=false", "checkpoint.every=null", "global_batch=8", "data.build.rows=16",
          "layout.max_tokens_per_gpu=256"]


def _train(run_dir, nproc, *sets):
    args = [sys.executable, "-m", "openrecipes", "train", str(EXAMPLE), "--nproc", str(nproc)]
    for item in (*COMMON, f"run_dir={run_dir}", *sets):
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics(run_dir)


def test_lora_data_parallel_matches_one_process(tmp_path):
    from safetensors.torch import load_file

    one = _train(tmp_path / "one", 1)
    two = _train(tmp_path / "two", 2, "layout.dp=2")
    assert_same(two, one)
    a = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)  # the adapters did train
