"""Peak memory per pipeline stage: each rank's peak, gathered once per step, reduced to the largest of each stage.

The step record's ``peak_memory_gib`` is the largest over all ranks; with pipeline parallelism the stages hold
different layers (the first the embedding, the last the head and the loss), so the card reports each stage's peak.
"""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist


def rank_peak_bytes(device: torch.device, cuda_peak: int | None) -> float:
    """This rank's peak so far: the CUDA allocator's peak on a GPU, else the process's peak resident memory (the
    only peak the CPU allocator leaves to read; it includes the interpreter and libraries)."""
    if device.type == "cuda" and cuda_peak is not None:
        return float(cuda_peak)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(maxrss if sys.platform == "darwin" else maxrss * 1024)  # bytes on macOS, KiB on Linux


def peak_gib_per_stage(peak_bytes: float, pp_rank: int, pp_size: int, device: torch.device) -> list[float]:
    """The largest peak of the ranks of each stage, stage 0 first, in GiB; every rank takes part (one all_gather of
    two numbers)."""
    mine = torch.tensor([float(pp_rank), peak_bytes], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather(gathered, mine)
    stages = [0.0] * pp_size
    for stage, peak in (pair.tolist() for pair in gathered):
        stages[int(stage)] = max(stages[int(stage)], peak)
    return [round(peak / 2**30, 4) for peak in stages]
