"""Offloaded optimizer state pinned in place: page-locked, zeroed, on pages of its own, and the same updates."""

import pytest
import torch

from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam
from openrecipes.optim.pinned import REGISTER_MIN_BYTES, pinned_empty, pinned_zeros

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape,dtype", [((3, 1 << 19), torch.bfloat16), ((1 << 20,), torch.int16),
                                         ((5, 7), torch.float32)])
def test_pinned_tensors_are_page_locked_zeros(shape, dtype):
    before = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0)
    tensor = pinned_zeros(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_pinned()
    assert torch.count_nonzero(tensor) == 0
    large = tensor.numel() * tensor.element_size() >= REGISTER_MIN_BYTES
    grown = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0) - before
    assert (grown == 0) if large else (grown > 0)  # large ones bypass the rounding caching allocator
    device = torch.arange(tensor.numel(), device="cuda").to(dtype).view(shape)
    tensor.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(tensor.cuda(), device)


def test_two_neighbours_register_without_clashing():
    tensors = [pinned_empty((REGISTER_MIN_BYTES + 3,), torch.uint8) for _ in range(8)]
    assert all(t.is_pinned() for t in tensors)
    del tensors  # each unregisters as it goes
    again = pinned_zeros((REGISTER_MIN_BYTES,), torch.uint8)
    assert again.is_pinned()


def test_offloaded_updates_equal_on_device_updates():
    def run(fraction):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(torch.bfloat16).cuda())
              for s in [(1024, 1024), (3, 1 << 18), (4097,)]]
        opt = MixedPrecisionAdam(ps, AdamConfig(master="remainder", moment_dtype="bf16", lr=1e-3,
                                                offload_fraction=fraction))
        for _ in range(3):
            for p in ps:
                p.main_grad = (torch.randn(p.shape, generator=g) * 0.1).cuda()
            opt.step()
        opt.wait_for_host_state()
        return [p.detach().clone() for p in ps]

    assert all(torch.equal(a, b) for a, b in zip(run(0.0), run(1.0)))
