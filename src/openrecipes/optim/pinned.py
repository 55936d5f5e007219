"""Page-locked host tensors for offloaded optimizer state, pinned in place.

torch's pinned allocator (``pin_memory=True``) takes each block from a caching allocator that rounds it up to a power
of two and pins it with ``cudaHostAlloc``; for an offloaded optimizer, whose state is a few very large tensors, that
is slow and wasteful. On one H200 the state of 4.4 B parameters (bf16 moments and int16 remainders, 24.4 GiB) took
19.8 s and reserved 33.6 GiB that way; zeroed first (the pages touched by all cores) and then registered in place
with ``cudaHostRegister``, 2.8 s and exactly 24.4 GiB (bench/pinned_state_alloc.py, BENCHMARKS.md). Large tensors
are registered here, on whole pages of their own (registering a page another allocation shares would fail); small
ones come from torch's allocator. torch's ``is_pinned()`` knows only its own allocator's blocks and answers False for
these; copies from and to them are asynchronous all the same.
"""

from __future__ import annotations

import os
import weakref

import torch

REGISTER_MIN_BYTES = 1 << 20  # below a MiB the rounding costs little and torch's allocator is as fast
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def pinned_zeros(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled page-locked host tensor. Raises RuntimeError naming the size when the host cannot lock that
    much memory."""
    count = 1
    for size in shape:
        count *= int(size)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes < REGISTER_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    span = -(-nbytes // _PAGE) * _PAGE
    raw = torch.zeros(span + _PAGE, dtype=torch.uint8)  # every page touched in parallel before the driver locks it
    start = (-raw.data_ptr()) % _PAGE
    region = raw[start:start + span]
    code = int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), span, 0))
    if code != 0:
        raise RuntimeError(f"offload: could not page-lock {span / 2**30:.2f} GiB of host memory for optimizer "
                           f"state (cudaHostRegister error {code}); lower offload.fraction or raise the host's "
                           "locked-memory limit")
    tensor = region[:nbytes].view(dtype).view(shape)
    weakref.finalize(tensor, _unregister, region.data_ptr())  # before the pages go back with the tensor
    return tensor
