"""LoRA (attention and expert adapters) under every layout against one process: fp32, gloo, two processes each.

DP2-EP2: FSDP2 shards the frozen base and the dense adapters, the expert adapters shard with their experts.
TP2-EP2 with sequence parallelism: the attention adapters split with their projections, the experts over EP.
PP2: each stage trains its layers' adapters; the saved adapter gathers both stages. CP2-ETP2: the adapters see half a
row, and the expert adapters are split with their experts' FFN over etp (gate/up's B and down's A by the FFN width, the
other factor whole, its gradient summed over etp).
Losses and gradient norms equal one process's (1e-5), and so does the saved PEFT adapter; the CP2-ETP2 run's training
checkpoint, read whole in one process (as a resume under another layout reads it), holds one process's adapters. A
large Adam epsilon keeps
the update a smooth function of the gradient: near-zero gradients of some expert adapters would otherwise turn
summation-order noise into updates of +-lr.
"""

from pathlib import Path

import pytest
import torch

from tests.distributed.test_layouts import assert_same, train_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-lora.yaml"
COMMON = ["steps=3", "logging.progress=false", "checkpoint.every=null", "checkpoint.at_end=false", "global_batch=8",
          "data.build.rows=16", "layout.max_tokens_per_gpu=256", "optimizer.eps=1e-3"]
LAYOUTS = {
    "DP2-EP2": ["layout.dp=2", "layout.ep=2"],
    "TP2-EP2-SP": ["layout.dp=1", "layout.tp=2", "layout.sequence_parallel=true", "layout.ep=2"],
    "PP2": ["layout.dp=1", "layout.pp=2"],
    "CP2-ETP2": ["layout.dp=1", "layout.cp=2", "layout.etp=2", "checkpoint.at_end=true"],
}


def _train(run_dir, nproc, *sets):
    return train_metrics(run_dir, *sets, nproc=nproc, example=EXAMPLE, common=COMMON)


def _adapter(run_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


def _saved_adapters(run_dir):
    """The adapters of the run's last training save, whole, by their training names."""
    from openrecipes.checkpoint.safe_load import METADATA_FILE, load_dcp, read_dcp_metadata
    from openrecipes.checkpoint.training_save import MODEL_PREFIX

    (save,) = sorted((Path(run_dir) / "checkpoints").glob("step-*"))
    stored = read_dcp_metadata(save / METADATA_FILE).state_dict_metadata
    state = {key.removeprefix(MODEL_PREFIX): torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for key, item in stored.items() if key.startswith(MODEL_PREFIX) and ".lora_" in key}
    load_dcp({"model": state}, save, no_dist=True)
    return state


@pytest.mark.slow
def test_lora_layouts_match_one_process(tmp_path):
    one = _train(tmp_path / "one", 1, "checkpoint.at_end=true")
    reference, reference_saved = _adapter(tmp_path / "one"), _saved_adapters(tmp_path / "one")
    assert any(".experts.lora_gate_up." in k for k in reference_saved)
    assert any("experts" in k for k in reference) and any("q_proj" in k for k in reference)
    assert any(v.abs().max() > 0 for k, v in reference.items() if "lora_B" in k)  # the adapters did train
    for label, sets in LAYOUTS.items():
        run_dir = tmp_path / label
        assert_same(_train(run_dir, 2, *sets), one)
        adapter = _adapter(run_dir)
        assert adapter.keys() == reference.keys(), label
        for key in reference:
            torch.testing.assert_close(adapter[key], reference[key], rtol=1e-5, atol=1e-7, msg=f"{label}: {key}")
        if "checkpoint.at_end=true" in sets:
            saved = _saved_adapters(run_dir)
            assert saved.keys() == reference_saved.keys(), label
            for key in saved:
                torch.testing.assert_close(saved[key], reference_saved[key], rtol=1e-5, atol=1e-7,
                                           msg=f"{label}: saved {key}")
