"""Host memory is planned: the prediction follows what offload keeps on the host, and a run that would not fit the
host is refused before it starts, naming the prediction and what is available."""

import pytest
import torch

from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.config.recipe import recipe_from_dict
from openrecipes.plan.hardware import GIB
from openrecipes.plan.host import available_host_bytes, check_host_memory, predict_host_memory
from openrecipes.parallel.mesh import single_process


def _recipe(**sections):
    tree = {"model": "qwen3-moe-tiny", "data": {"build": {"row_tokens": 256}}, "layout": {"max_tokens_per_gpu": 512},
            "steps": 1, "global_batch": 2, "precision": "bf16", **sections}
    return recipe_from_dict(tree)


def _predict(recipe, processes=1):
    return predict_host_memory(recipe, recipe_model_config(recipe), row_tokens=256, processes_per_node=processes)


def test_offloaded_optimizer_state_is_what_the_optimizer_keeps_on_the_host():
    """bf16 with fp32 masters (12 B an element: master and two moments), offload 1.0: the planner's optimizer state
    against the bytes of the state tensors MixedPrecisionAdam actually holds on the CPU."""
    from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam
    from openrecipes.train import engine

    recipe = _recipe(offload={"fraction": 1.0})
    model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
    optimizer = MixedPrecisionAdam(list(model.parameters()), AdamConfig(master="fp32", offload_fraction=1.0))
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for name, t in state.items()
               if name != "step")
    predicted = _predict(recipe).parts_gib["optimizer_state"] * GIB
    assert predicted == pytest.approx(held, rel=0.02)


def test_prediction_grows_with_what_is_offloaded_and_the_processes():
    none = _predict(_recipe())
    half = _predict(_recipe(offload={"fraction": 0.5, "update": "host"}))
    full = _predict(_recipe(offload={"fraction": 1.0}))
    acts = _predict(_recipe(offload={"activations": True}, recompute={"granularity": "full"}))
    assert none.parts_gib["optimizer_state"] == 0 and none.parts_gib["activations"] == 0
    assert 0 < half.parts_gib["optimizer_state"] < full.parts_gib["optimizer_state"]
    assert half.parts_gib["gradient_copies"] > 0 and full.parts_gib["gradient_copies"] == 0  # device: streamed
    assert acts.parts_gib["activations"] > 0 and acts.parts_gib["optimizer_state"] == 0
    assert _predict(_recipe(offload={"fraction": 1.0}), processes=4).total_gib == pytest.approx(4 * full.total_gib)


def test_a_run_beyond_the_available_memory_is_refused_naming_both():
    prediction = _predict(_recipe(offload={"fraction": 1.0}))
    check_host_memory(prediction, int(prediction.total_gib * GIB) + 1)  # fits: nothing happens
    check_host_memory(prediction, None)  # a host that does not say: nothing to compare
    with pytest.raises(ValueError, match=rf"about {prediction.total_gib:,.1f} GiB .* only 1.0 GiB is available"):
        check_host_memory(prediction, GIB)


def test_train_refuses_before_starting(tmp_path):
    from openrecipes.train.cli import _check_host_memory

    recipe = _recipe(offload={"fraction": 1.0}, run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="host memory: .* 0.5 GiB is available"):
        _check_host_memory(recipe, recipe_model_config(recipe), 8, available_bytes=GIB // 2)
    assert not (tmp_path / "run").exists()


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_host_bytes(str(meminfo)) == 8000000 * 1024
    meminfo.write_text("MemTotal:       16000000 kB\n")
    assert available_host_bytes(str(meminfo)) is None
    assert available_host_bytes(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("optimizer,per_element", [
    ({"precision_aware": False}, 12),                                   # fp32 master, fp32 moments
    ({"precision_aware": True, "moment_dtype": "bf16"}, 6),             # int16 remainder, bf16 moments
    ({"precision_aware": True, "moment_dtype": "fp32"}, 10),            # int16 remainder, fp32 moments
    ({"precision_aware": True, "param_remainders": False, "moment_dtype": "bf16"}, 8),  # fp32 master, bf16 moments
])
def test_offloaded_state_follows_the_recipe_optimizer(optimizer, per_element):
    """Host bytes per offloaded element as the optimizer stores them (docs/train.md's table)."""
    from openrecipes.plan.host import optimizer_state_bytes

    recipe = _recipe(offload={"fraction": 1.0}, optimizer=optimizer)
    assert optimizer_state_bytes(recipe) == per_element
    base = _predict(_recipe(offload={"fraction": 1.0}))
    assert _predict(recipe).parts_gib["optimizer_state"] == pytest.approx(
        base.parts_gib["optimizer_state"] * per_element / 12)
