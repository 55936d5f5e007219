"""The DTensor knowledge the optimizer needs, kept here so that only parallel/, train/ and checkpoint/ import
torch.distributed."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 / tensor or expert parallel), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def shard_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's piece of a state tensor of ``param``'s shape) as a DTensor laid out like ``param``, so
    torch.distributed.checkpoint can save and reshard it."""
    device = param.to_local().device
    return DTensor.from_local(value.to(device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
