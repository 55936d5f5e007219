"""The global gradient norm and clip factor on one process, against torch's own total norm."""

import pytest
import torch

from openrecipes.parallel.gradients import grad_norm_and_clip_scale


@pytest.mark.parametrize("max_norm", [None, 1.0, 1e6])
def test_norm_and_clip_scale_match_torch(max_norm):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * scale
             for shape, scale in (((3, 5), 1.0), ((7,), 100.0), ((2, 2, 4), 1e-3))]
    grads.append(torch.randn(4, 4, generator=generator).to(torch.bfloat16))
    expected = torch.nn.utils.get_total_norm(grads, 2.0).item()
    norm, scale = grad_norm_and_clip_scale(grads, max_norm)
    assert norm == pytest.approx(expected, rel=1e-6)
    assert scale == (1.0 if max_norm is None or expected <= max_norm else pytest.approx(max_norm / expected, rel=1e-5))
