"""Process groups and device meshes for a validated layout.

The ranks form a ``pp x dp x cp x tp`` mesh: the pp coordinate is the stage, the cp ranks of a row hold its contiguous
chunks and the tp ranks of a chunk its sequence-parallel parts, and FSDP2 shards the dense weights over ``dp`` (on
top of TP's DTensors). Expert layers regroup the ranks of a stage as ``edp x ep x etp``: etp consecutive
ranks split each expert's FFN, ep such groups hold E/ep experts each, and the edp groups of equal expert shards sum
their gradients. The expert mesh is separate from the dense one: FSDP leaves the experts to expert parallelism.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from openrecipes.config.layout import LayoutConfig, unsupported_reason


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    rank: int
    world_size: int
    device: torch.device
    dp_rank: int
    dp_size: int
    ep_size: int
    dense_mesh: DeviceMesh | None   # ("dp",)
    expert_mesh: DeviceMesh | None  # ("edp", "ep", "etp"); None when the experts are not split
    etp_size: int = 1
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


def allocator_conflict(kind: str, environ: dict[str, str]) -> str | None:
    """Why PYTORCH_CUDA_ALLOC_CONF in ``environ`` contradicts ``kernels.allocator`` (it sets expandable_segments the
    other way), or None. Its other settings (max_split_size_mb, ...) are kept: the recipe sets only the segments."""
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments" and (value.strip().lower() == "true") != (kind == "expandable"):
            return (f"PYTORCH_CUDA_ALLOC_CONF={conf} sets expandable_segments:{value.strip()}, but the recipe's "
                    f"kernels.allocator is {kind}: the recipe decides (unset the variable's expandable_segments, or "
                    f"set kernels.allocator: {'caching' if kind == 'expandable' else 'expandable'})")
    return None


def use_cuda_allocator(kind: str) -> None:
    """``kernels.allocator``: expandable segments on or off for this process's CUDA allocations (nothing on CPU). A
    PYTORCH_CUDA_ALLOC_CONF that says otherwise is refused rather than overridden in silence."""
    if not torch.cuda.is_available():
        return
    conflict = allocator_conflict(kind, dict(os.environ))
    if conflict:
        raise ValueError(conflict)
    setting = f"expandable_segments:{kind == 'expandable'}"
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_settings is None:  # torch before 2.9
        set_settings = torch.cuda.memory._set_allocator_settings
    set_settings(setting)


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


def close_distributed() -> None:
    """Leave the process group of a run that finished. A gloo group left to the interpreter's exit can abort the
    process while its worker threads still hold tensors (``terminate called without an active exception``), which
    turns a finished rank into a failed one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def single_process(device: torch.device) -> ParallelState:
    """The layout of one process: every size 1, no mesh. Functions take a state always, never None."""
    return ParallelState(rank=0, world_size=1, device=device, dp_rank=0, dp_size=1, ep_size=1, dense_mesh=None,
                         expert_mesh=None)


def build_parallel_state(layout: LayoutConfig, device: torch.device) -> ParallelState:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    reason = unsupported_reason(layout)
    if reason:
        raise ValueError(reason)
    if world == 1:
        return single_process(device)
    root = init_device_mesh(device.type, (layout.pp, layout.dp, layout.cp, layout.tp),
                            mesh_dim_names=("pp", "dp", "cp", "tp"))
    expert = None
    if layout.ep * layout.etp > 1:
        stage_ranks = layout.dp * layout.cp * layout.tp
        grid = torch.arange(world).view(layout.pp, stage_ranks // (layout.ep * layout.etp), layout.ep, layout.etp)
        expert = DeviceMesh(device.type, grid, mesh_dim_names=("pp", "edp", "ep", "etp"))["edp", "ep", "etp"]
    return ParallelState(rank=rank, world_size=world, device=device, dp_rank=root["dp"].get_local_rank(),
                         dp_size=layout.dp, ep_size=layout.ep, etp_size=layout.etp,
                         dense_mesh=root["dp"] if layout.dp > 1 else None, expert_mesh=expert,
                         tp_size=layout.tp, tp_mesh=root["tp"] if layout.tp > 1 else None,
                         cp_size=layout.cp, cp_mesh=root["cp"] if layout.cp > 1 else None,
                         pp_size=layout.pp, pp_rank=root["pp"].get_local_rank(),
                         pp_group=root["pp"].get_group() if layout.pp > 1 else None)
