"""recompute.granularity full_keep_attention: the layer is recomputed but its attention kernel runs once, and the
loss and gradients are those of keeping every activation."""

import pytest
import torch

from openrecipes.models.common.attention import attention
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.qwen3_moe.family import FAMILY
from openrecipes.parallel.recompute import KeptAttentionCore, apply_recompute


class CountingKernel:
    """The reference attention, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q, k, v, *, scale, documents, window):
        self.calls += 1
        return attention(q, k, v, scale=scale, documents=documents, window=window, backend="reference")


def _model(granularity: str):
    config = FAMILY.named_configs["qwen3-moe-tiny"]()
    kernels = KernelOptions(attention="reference", experts="loop", balanced_routing=True)
    model = FAMILY.build(config, device="cpu", dtype=torch.float32, seed=0, kernels=kernels)
    kernel = CountingKernel()
    layers = list(model.model.layers.values())
    for layer in layers:
        layer.self_attn.backend = kernel
    apply_recompute(layers, granularity=granularity, attention_of=lambda layer: layer.self_attn)
    return model, kernel, config


def _microbatches(config, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (2, 32), generator=generator) for _ in range(count)]


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())


@pytest.mark.parametrize("order", ["each forward then its backward", "both forwards then both backwards"])
def test_the_kernel_runs_once_and_every_gradient_is_unchanged(order):
    results = {}
    for granularity in ("none", "full", "full_keep_attention"):
        model, kernel, config = _model(granularity)
        batches = _microbatches(config, 2)
        if order.startswith("each"):
            losses = []
            for ids in batches:
                losses.append(_loss(model, ids))
                losses[-1].backward()
        else:  # a pipeline's order: the backwards follow the forwards in the same order
            losses = [_loss(model, ids) for ids in batches]
            for loss in losses:
                loss.backward()
        results[granularity] = (kernel.calls, [loss.item() for loss in losses],
                                {name: p.grad.clone() for name, p in model.named_parameters()})
        kept = [layer.self_attn.backend for layer in model.model.layers.values()]
        if granularity == "full_keep_attention":
            assert all(isinstance(backend, KeptAttentionCore) and not backend.kept for backend in kept)
    layers = len(model.model.layers)
    assert results["none"][0] == 2 * layers
    assert results["full"][0] == 4 * layers  # the recompute runs the kernel again
    assert results["full_keep_attention"][0] == 2 * layers
    for granularity in ("full", "full_keep_attention"):
        assert results[granularity][1] == results["none"][1]
        for name, grad in results["none"][2].items():
            torch.testing.assert_close(results[granularity][2][name], grad, rtol=0, atol=0, msg=name)


def test_without_gradients_nothing_is_kept():
    model, kernel, config = _model("full_keep_attention")
    with torch.no_grad():
        _loss(model, _microbatches(config, 1)[0])
    assert kernel.calls == len(model.model.layers)
    assert not any(layer.self_attn.backend.kept for layer in model.model.layers.values())


def test_a_recompute_without_a_kept_output_is_an_error():
    model, _, config = _model("full_keep_attention")
    loss = _loss(model, _microbatches(config, 1)[0])
    for layer in model.model.layers.values():
        layer.self_attn.backend.kept.clear()
    with pytest.raises(RuntimeError, match="full_keep_attention"):
        loss.backward()
