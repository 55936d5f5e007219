"""Seeded initialisation that gives every tensor the same values however the model is split."""

from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def fill_seeded_normal_(param: torch.Tensor, name: str, *, seed: int, std: float) -> None:
    """Fill ``param`` in place with N(0, std) drawn from a generator seeded by (seed, name).

    The draw covers the whole tensor, so a pipeline stage (which holds some tensors) and an expert-parallel shard (a
    DTensor holding a slice of one) get exactly the values one process would have."""
    local = param.to_local() if isinstance(param, DTensor) else param
    generator = torch.Generator(device=local.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(param.shape, generator=generator, dtype=torch.float32, device=local.device) * std
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        values = values[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
    local.copy_(values)
