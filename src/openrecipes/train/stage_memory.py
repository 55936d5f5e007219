"""Peak memory per pipeline stage: each rank's peak, gathered once per step, reduced to the largest of each stage.

The step record's ``peak_memory_gib`` is the largest over all ranks; with pipeline parallelism the stages hold
different layers (the first the embedding, the last the head and the loss), so the card reports each stage's peak.
The build's peak and the per-phase trace of ``debug.memory_trace`` are read here too.
"""

from __future__ import annotations

import resource
import sys
import time

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


def build_peak_and_reset(device: torch.device) -> float | None:
    """Peak memory of building the model (max over ranks), then restart the counter: step records report the
    training peak, and the first one also the build's (loading a checkpoint builds the whole model on every rank).
    The blocks the build cached are handed back first: else the training's reserved peak starts at the build's (a
    48-layer LoRA base built at 131.9 GiB reserved trained in 80.8 GiB allocated), and the tuner reads that reserve
    as the allocator's."""
    if device.type != "cuda":
        return None
    peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return float(peak) / 2**30


class MemoryTrace:
    """With debug.memory_trace on CUDA: this rank's memory at the start of the step and the peak of each
    phase (the peak counter restarts at every mark, so the recorded run-wide peak stays the maximum of them).
    ``timed``: also the seconds of each phase (``times``), the device drained at each mark, so a phase's kernels
    count in it and not in the next (a step measured this way loses the overlap of phases: for one rank's figures)."""

    def __init__(self, device: torch.device, enabled: bool, *, timed: bool = False) -> None:
        self.enabled = device.type == "cuda" and enabled
        self.device, self.phases = device, {}
        self.timed, self.times = timed, {}
        self._clock = self._now() if timed else 0.0
        if self.enabled:
            self.phases["start"] = round(torch.cuda.memory_allocated(device) / 2**30, 3)
            self._peak_so_far = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def peak_allocated(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device)
        return max(peak, self._peak_so_far) if self.enabled else peak

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.timed:
            now = self._now()
            self.times[phase] = now - self._clock
            self._clock = now
        if self.enabled:
            peak = torch.cuda.max_memory_allocated(self.device)
            self.phases[f"{phase}_peak"] = round(peak / 2**30, 3)
            self._peak_so_far = max(self._peak_so_far, peak)
            torch.cuda.reset_peak_memory_stats(self.device)
