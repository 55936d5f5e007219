"""Recompute variants and activation offload change what a step keeps for its backward, never its loss or gradients."""

import pytest
import torch

from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.train import engine
from openrecipes.parallel.mesh import single_process


def _batch(recipe):
    from openrecipes.data.batching import RowLoader, load_rows

    loader = RowLoader(dataset=load_rows(recipe.data.rows), global_batch=2, dp_rank=0, dp_size=1,
                       rows_per_microbatch=2)
    return loader.microbatches(0)[0]


def _step(recipe, batch):
    """(loss, gradients by name, bytes autograd keeps outside recomputed regions for the backward: each storage
    once, parameters left out)."""
    model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
    params = {p.data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        if tensor.data_ptr() not in params:
            kept[tensor.data_ptr()] = max(kept.get(tensor.data_ptr(), 0), tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine.microbatch_loss_sum(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(kept.values())


def _assert_same_numbers(got, reference, what):
    torch.testing.assert_close(got[0], reference[0], msg=what)
    assert got[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(got[1][name], grad, msg=f"{what}: {name}")


def test_each_recompute_variant_keeps_less_and_computes_the_same(make_recipe):
    """4 layers of the tiny Qwen3-MoE, 2 packed rows: every variant keeps fewer bytes than none; recomputing two of
    the layers keeps more than recomputing all four and less than none; the loss and every gradient are unchanged."""
    base = make_recipe()
    batch = _batch(base)
    none = _step(base, batch)
    kept = {}
    for granularity, method, layers in [("full", "uniform", 1), ("full", "block", 2), ("selective", "uniform", 1),
                                        ("full_keep_attention", "uniform", 1), ("full_keep_attention", "block", 2),
                                        ("attention_core", "uniform", 1), ("experts", "uniform", 1),
                                        ("experts", "block", 2)]:
        recipe = make_recipe(recompute={"granularity": granularity, "method": method, "num_layers": layers})
        result = _step(recipe, batch)
        _assert_same_numbers(result, none, f"{granularity}/{method}/{layers}")
        kept[granularity, method] = result[2]
        assert result[2] < none[2], (granularity, method)
    assert kept["full", "uniform"] < kept["full", "block"] < none[2]
    assert kept["experts", "uniform"] < kept["experts", "block"]


def test_num_layers_needs_method_block(make_recipe):
    with pytest.raises(ValueError, match="recompute.num_layers"):
        make_recipe(recompute={"granularity": "experts", "num_layers": 2})


def test_activation_offload_moves_the_layer_inputs_and_computes_the_same(make_recipe, monkeypatch):
    """With full recompute each layer keeps only its inputs: exactly those bytes (4 layers x (2 rows x 64 tokens x
    hidden + the RoPE angles), fp32) go through the offload hooks, and the loss and gradients are the same as without offload."""
    from openrecipes.models.common.rope import rope_angles
    from openrecipes.parallel import activation_offload

    hooks = []
    real = activation_offload.apply_activation_offload
    monkeypatch.setattr(activation_offload, "apply_activation_offload", lambda layers: hooks.append(real(layers))
                        or hooks[-1])
    base = make_recipe(recompute={"granularity": "full"})
    batch = _batch(base)
    reference = _step(base, batch)
    offloaded = _step(make_recipe(recompute={"granularity": "full"}, offload={"activations": True}), batch)
    _assert_same_numbers(offloaded, reference, "offload.activations")
    config = recipe_model_config(base)
    rows, tokens = batch["input_ids"].shape
    angles = rope_angles(batch["position_ids"], config.head_dim, config.rope_theta)  # the layer's other input
    assert len(hooks) == 1
    assert hooks[0].offloaded_bytes == config.num_hidden_layers * (rows * tokens * config.hidden_size
                                                                   + angles.numel()) * 4
    # without recompute every activation a layer saves moves (more bytes)
    everything = _step(make_recipe(offload={"activations": True}), batch)
    _assert_same_numbers(everything, reference, "offload.activations without recompute")
    assert hooks[1].offloaded_bytes > 4 * hooks[0].offloaded_bytes


def test_activation_offload_leaves_weights_and_their_views():
    from openrecipes.parallel.activation_offload import apply_activation_offload

    class TransposedWeight(torch.nn.Module):  # the matmul saves its input and a view of the weight
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16, 8))

        def forward(self, x):
            return x @ self.weight.t()

    layer = TransposedWeight()
    offload = apply_activation_offload([layer])
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).sum().backward()
    assert offload.offloaded_bytes == x.numel() * 4
    assert layer.weight.grad is not None


def test_an_offloaded_activation_comes_back_with_the_strides_it_was_saved_with():
    """A compiled backward asserts the strides of what it saved: a transposed view (attention's query) is copied to
    the host as it is laid out, and what cannot keep its strides (an expanded view) is copied dense, values equal."""
    from openrecipes.parallel.activation_offload import host_copy

    transposed = torch.randn(2, 16, 4, 8).transpose(1, 2)
    expanded = torch.randn(3, 1).expand(3, 5)
    for saved in (transposed, expanded):
        host = host_copy(saved, pin_memory=False)
        restored = host.to(saved.device)
        torch.testing.assert_close(restored, saved, rtol=0, atol=0)
        assert host.untyped_storage().data_ptr() != saved.untyped_storage().data_ptr()
    assert host_copy(transposed, pin_memory=False).stride() == transposed.stride() != transposed.contiguous().stride()
    assert host_copy(expanded, pin_memory=False).stride() == (5, 1)


@pytest.mark.parametrize("conf, kind, refused", [
    ("expandable_segments:False", "expandable", True), ("expandable_segments:True", "caching", True),
    ("expandable_segments:True", "expandable", False), ("max_split_size_mb:128", "caching", False),
    ("max_split_size_mb:128,expandable_segments:false", "expandable", True), ("", "expandable", False),
])
def test_an_allocator_variable_that_contradicts_the_recipe_is_refused(conf, kind, refused):
    from openrecipes.parallel.mesh import allocator_conflict

    why = allocator_conflict(kind, {"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {})
    assert (why is not None) == refused
    assert why is None or f"kernels.allocator is {kind}" in why
