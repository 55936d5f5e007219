"""Seeded initialisation of sharded (DTensor) parameters: the whole tensor's values, this rank's slice."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from openrecipes.models.common.init import fill_seeded_normal_, seeded_normal


@torch.no_grad()
def fill_sharded_seeded_normal_(param: torch.Tensor, name: str, *, seed: int, std: float) -> None:
    """``fill_seeded_normal_`` for a DTensor too: the draw covers the whole tensor, so an expert-parallel shard
    gets exactly the values one process would have."""
    if not isinstance(param, DTensor):
        fill_seeded_normal_(param, name, seed=seed, std=std)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    values = seeded_normal(param.shape, name, seed=seed, std=std, device=local.device)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local.copy_(values[tuple(slice(start, start + size) for start, size in zip(offset, shape))])
