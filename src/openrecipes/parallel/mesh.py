"""Process groups and device meshes for a validated layout.

With pipeline parallelism the ranks form a ``pp x edp x ep`` mesh: the pp coordinate is the stage, FSDP2 runs over
the stage's dp = edp x ep ranks and expert parallelism over its ep ranks.

Dense layers shard over the data-parallel mesh ``dp`` (all ranks while tp = cp = pp = 1). Expert layers regroup the
same ranks as ``edp x ep``: ep consecutive ranks hold the E/ep experts each, and the edp groups of equal expert shards
average (sum) their gradients. Both meshes come from one root mesh so FSDP2 and DTensor can compose them.

With tensor (or context) parallelism the ranks form a ``pp x dp x tp`` (``dp x cp``) mesh: FSDP2 shards over dp on top
of the TP DTensors, and the expert layers regroup the ranks of a stage as ``edp x ep``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from openrecipes.parallel.layout import LayoutConfig, unsupported_reason


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    rank: int
    world_size: int
    device: torch.device
    dp_rank: int
    dp_size: int
    ep_size: int
    dense_mesh: DeviceMesh | None   # ("dp",)
    expert_mesh: DeviceMesh | None  # ("edp", "ep")
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: object | None = None
    tp_size: int = 1
    tp_mesh: DeviceMesh | None = None
    cp_size: int = 1
    cp_mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_minutes: float = 10.0) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment (or stay single-process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if device.type == "cuda" else None)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def build_parallel_state(layout: LayoutConfig, device: torch.device) -> ParallelState:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    reason = unsupported_reason(layout)
    if reason:
        raise ValueError(reason)
    if layout.tp * layout.cp > 1:
        return _sequence_parallel_state(layout, rank, world, device)
    if layout.pp > 1:
        root = init_device_mesh(device.type, (layout.pp, layout.dp // layout.ep, layout.ep),
                                mesh_dim_names=("pp", "edp", "ep"))
        expert = root["edp", "ep"]
        dense = expert._flatten("dp") if layout.dp > 1 else None
        return ParallelState(rank=rank, world_size=world, device=device,
                             dp_rank=dense.get_local_rank() if dense is not None else 0, dp_size=layout.dp,
                             ep_size=layout.ep, dense_mesh=dense, expert_mesh=expert if layout.ep > 1 else None,
                             pp_size=layout.pp, pp_rank=root["pp"].get_local_rank(), pp_group=root["pp"].get_group())
    if world == 1:
        return ParallelState(rank=0, world_size=1, device=device, dp_rank=0, dp_size=1, ep_size=1,
                             dense_mesh=None, expert_mesh=None)
    root = init_device_mesh(device.type, (world // layout.ep, layout.ep), mesh_dim_names=("edp", "ep"))
    dense = root._flatten("dp")
    return ParallelState(rank=rank, world_size=world, device=device, dp_rank=dense.get_local_rank(),
                         dp_size=world, ep_size=layout.ep, dense_mesh=dense, expert_mesh=root)


def _sequence_parallel_state(layout: LayoutConfig, rank: int, world: int, device: torch.device) -> ParallelState:
    """TP (with SP) or CP, inside dp and pipeline stages: ranks form a ``pp x dp x seq`` mesh, the seq ranks of a row
    holding its slices (and passing them to the same seq rank of the next stage).

    Every rank holds different tokens, so the expert layers regroup the ranks of a stage as ``edp x ep`` (ep
    consecutive ranks); their mesh is separate from the dense one because FSDP leaves the experts to expert
    parallelism."""
    name, size = ("tp", layout.tp) if layout.tp > 1 else ("cp", layout.cp)
    root = init_device_mesh(device.type, (layout.pp, layout.dp, size), mesh_dim_names=("pp", "dp", name))
    expert = None
    if layout.ep > 1:
        grid = torch.arange(world).view(layout.pp, layout.dp * size // layout.ep, layout.ep)
        expert = DeviceMesh(device.type, grid, mesh_dim_names=("pp", "edp", "ep"))["edp", "ep"]
    return ParallelState(rank=rank, world_size=world, device=device, dp_rank=root["dp"].get_local_rank(),
                         dp_size=layout.dp, ep_size=layout.ep, dense_mesh=root["dp"] if layout.dp > 1 else None,
                         expert_mesh=expert, tp_size=layout.tp, tp_mesh=root["tp"] if layout.tp > 1 else None,
                         cp_size=layout.cp, cp_mesh=root["cp"] if layout.cp > 1 else None,
                         pp_size=layout.pp, pp_rank=root["pp"].get_local_rank(),
                         pp_group=root["pp"].get_group() if layout.pp > 1 else None)
