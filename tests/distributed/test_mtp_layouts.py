"""Multi-token prediction (recipe ``mtp``, DeepSeek-V3's MTP layer) under data and expert parallelism against one
process: fp32, the tiny model, gloo on CPU.

DP2: FSDP2 shards the MTP layer like a decoder layer, and the MTP loss divides by the depth's targets over both ranks'
rows, as the main loss does. DP2-EP2: the MTP layer's routed experts are split over ep like every MoE layer's (its
sharding plan's ``extra_layers``); left whole, each rank would update them from its own rows alone, which the losses
and gradient norms barely show (1e-6) but the trained weights do (4e-4). The rows hold several documents, so the MTP
targets meet document starts on both ranks. Losses, gradient norms and ``mtp_loss`` equal one process's, and so do the
exported weights, the MTP layer's (``model.layers.3``) among them (measured within 1.2e-7). fp32 Adam moments: a bf16
moment near a rounding boundary turns a last-bit difference of the gradient into a 0.4% one of an update (one
element of 3,584 moved 1.5e-5 in 4 steps); a large Adam epsilon keeps the update a smooth function of the gradient
(tests/distributed/test_hf_export_layouts.py says why).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.test_layouts import assert_same, train, train_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-deepseek-v3-sft.yaml"
MTP = ("mtp.loss_weight=0.3", "model_overrides.num_nextn_predict_layers=1", "steps=4", "checkpoint.export_hf=true",
       "optimizer.eps=1e-3", "optimizer.moment_dtype=fp32")
LAYOUTS = {"DP2": ("layout.dp=2",), "DP2-EP2": ("layout.dp=2", "layout.ep=2")}
MTP_LAYER = "model.layers.3."  # the tiny model's 3 decoder layers, then its MTP layer under its checkpoint name


def _export(run_dir):
    return load_file(str(Path(run_dir) / "hf" / "model.safetensors"))


@pytest.mark.slow
def test_mtp_under_data_and_expert_parallelism_matches_one_process(tmp_path):
    one = train_metrics(tmp_path / "one", *MTP, example=EXAMPLE)
    assert all(r["mtp_loss"] > 0 for r in one)
    assert one[0]["sum_doc_len_sq"] < 8 * 256 ** 2  # 8 rows of 256 tokens: shorter documents, packed
    reference = _export(tmp_path / "one")
    assert any(k.startswith(MTP_LAYER + "mlp.experts.") for k in reference)
    for label, sets in LAYOUTS.items():
        candidate = train_metrics(tmp_path / label, *MTP, *sets, nproc=2, example=EXAMPLE)
        assert_same(candidate, one)
        for c, r in zip(candidate, one):
            assert c["mtp_loss"] == pytest.approx(r["mtp_loss"], rel=1e-5), (label, c["step"])
        weights = _export(tmp_path / label)
        assert weights.keys() == reference.keys(), label
        for key in reference:
            # another summation order: equal within fp32 rounding
            torch.testing.assert_close(weights[key], reference[key], rtol=1e-5, atol=1e-7, msg=f"{label}: {key}")


def test_pipeline_with_mtp_is_refused_before_a_worker_starts(tmp_path):
    result = train(tmp_path / "run", *MTP, "layout.dp=1", "layout.pp=2", "layout.pp_first_stage_layers=1", nproc=2,
                   example=EXAMPLE)
    assert result.returncode != 0
    assert "layout.pp: mtp is not supported with layout.pp=2" in result.stderr
