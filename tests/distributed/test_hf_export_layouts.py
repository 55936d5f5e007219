"""A training save written under DP2-EP2 (FSDP2 shards, experts split over ranks) exports the same Hugging Face
weights as the one-process run of the same recipe."""

import torch
from safetensors.torch import load_file

from tests.distributed.test_layouts import train


def test_dp2_ep2_save_exports_as_one_process(tmp_path):
    exports = {}
    for name, sets, nproc in (("one", ("layout.dp=1",), 1), ("dp2ep2", ("layout.dp=2", "layout.ep=2"), 2)):
        run_dir = tmp_path / name
        # eps 1e-3: Adam's first steps turn any gradient into a +-lr update, so a rounding-level gradient (an embedding
        # row whose contributions nearly cancel) would differ by 2 lr between layouts; a larger eps damps it
        result = train(run_dir, *sets, "steps=2", "checkpoint.export_hf=true", "optimizer.eps=1e-3", nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        exports[name] = load_file(run_dir / "hf" / "model.safetensors")
    one, sharded = exports["one"], exports["dp2ep2"]
    assert one.keys() == sharded.keys()
    for key in one:
        assert sharded[key].dtype == one[key].dtype == torch.float32, key
        # the layouts sum gradients in another order: equal within fp32 rounding, not bitwise
        torch.testing.assert_close(sharded[key], one[key], rtol=1e-4, atol=1e-5, msg=key)
