"""Offloaded optimizer state pinned in place: page-locked, zeroed, on pages of its own, and the same updates."""

import pytest
import torch

from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam
from openrecipes.optim.pinned import REGISTER_MIN_BYTES, pinned_zeros

pytestmark = pytest.mark.gpu


def _reserved() -> int:
    return torch.cuda.host_memory_stats().get("reserved_bytes.current", 0)


@pytest.mark.parametrize("shape,dtype", [((3, 1 << 19), torch.bfloat16), ((1 << 20,), torch.int16)])
def test_large_state_is_registered_in_place(shape, dtype):
    before = _reserved()
    tensor = pinned_zeros(shape, dtype)
    assert tuple(tensor.shape) == shape and tensor.dtype == dtype and torch.count_nonzero(tensor) == 0
    assert _reserved() == before  # not from torch's rounding caching allocator
    device = torch.arange(tensor.numel(), device="cuda").to(dtype).view(shape)
    tensor.copy_(device, non_blocking=True)  # an asynchronous copy into it lands whole
    torch.cuda.synchronize()
    assert torch.equal(tensor.cuda(), device)


def test_small_state_comes_from_torchs_pinned_allocator():
    tensor = pinned_zeros((5, 7), torch.float32)
    assert tensor.is_pinned() and torch.count_nonzero(tensor) == 0


def test_neighbours_register_without_sharing_a_page():
    # registering a page twice fails (RuntimeError here): each tensor has pages of its own
    tensors = [pinned_zeros((REGISTER_MIN_BYTES + 3,), torch.uint8) for _ in range(8)]
    for value, tensor in enumerate(tensors):
        tensor.copy_(torch.full(tensor.shape, value, dtype=torch.uint8, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    assert [int(t[0]) for t in tensors] == list(range(8)) and [int(t[-1]) for t in tensors] == list(range(8))
    del tensors  # each unregisters as it goes, so the same memory can be registered again
    assert int(pinned_zeros((REGISTER_MIN_BYTES,), torch.uint8).sum()) == 0


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
