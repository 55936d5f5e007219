"""The global gradient norm and clip factor on one process, against torch's own total norm and clip."""

import math

import pytest
import torch

from openrecipes.parallel.gradients import clip_scale, grad_norm_squared


def _grads() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * scale
             for shape, scale in (((3, 5), 1.0), ((7,), 100.0), ((2, 2, 4), 1e-3))]
    return grads + [torch.randn(4, 4, generator=generator).to(torch.bfloat16)]


@pytest.mark.parametrize("max_norm", [None, 1.0, 1e6])
def test_norm_and_clip_scale_match_torch(max_norm):
    grads = _grads()
    expected = torch.nn.utils.get_total_norm(grads, 2.0).item()
    norm_sq = grad_norm_squared(grads, torch.device("cpu"))
    assert norm_sq.dtype == torch.float64
    assert math.sqrt(norm_sq.item()) == pytest.approx(expected, rel=1e-6)
    scale = clip_scale(norm_sq.sqrt(), max_norm)
    assert scale.dtype == torch.float32 and scale.shape == ()
    # torch's clip, on parameters holding the gradients: the same factor, clamped to 1
    params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.float().clone()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm if max_norm is not None else math.inf,
                                         torch.tensor(expected))
    for grad, param in zip(grads, params):
        torch.testing.assert_close(grad.float() * scale, param.grad, rtol=1e-5, atol=0)
    if max_norm == 1.0:
        assert scale.item() < 1.0  # the case that clips

def test_a_non_finite_norm_is_left_unclipped():
    grads = _grads() + [torch.tensor([float("nan")])]
    norm_sq = grad_norm_squared(grads, torch.device("cpu"))
    assert math.isnan(norm_sq.item())
    assert clip_scale(norm_sq.sqrt(), 1.0).item() == 1.0
