"""Activation CPU offload (``offload.activations``): what each decoder layer saves for its backward waits in host
memory instead of on the device, and comes back when the backward needs it.

Hooks on each decoder layer install saved-tensor hooks for the duration of its forward. With full recompute the
layer saves only its input (the checkpoint keeps it for the recomputation), so that input is what moves; without
recompute every activation the layer saves moves. Parameters are never copied (they stay where they live). On a
GPU the copies go to pinned memory without blocking the host; on the CPU there is nothing to move and the hooks
only count. The cost is host memory (the planner counts it, ``plan/memory.py``) and the transfer time, which the
backward waits for.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ActivationOffload:
    """The saved-tensor hooks; ``offloaded_bytes`` counts what went to the host since the last ``reset``."""

    def __init__(self) -> None:
        self.offloaded_bytes = 0
        self.layer: nn.Module | None = None  # the layer whose forward runs
        self._weights: set[int] | None = None  # its parameters' storages, found at the first tensor it saves

    def reset(self) -> None:
        self.offloaded_bytes = 0

    def _is_weight(self, tensor: torch.Tensor) -> bool:
        """A parameter, or a view of one (a transposed weight a matmul saves): it stays where it lives. Looked up
        during the forward, when data parallelism has gathered the layer's parameters."""
        if isinstance(tensor, nn.Parameter):
            return True
        if self._weights is None:
            self._weights = {_storage(p) for p in self.layer.parameters()} if self.layer else set()
        storage = _storage(tensor)
        return storage is None or storage in self._weights  # a tensor without plain storage stays too

    def pack(self, tensor: torch.Tensor):
        if self._is_weight(tensor):
            return tensor
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type == "cpu":
            return tensor
        return tensor.device, host_copy(tensor, pin_memory=True)

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)  # preserve_format: the host copy's strides


def host_copy(tensor: torch.Tensor, *, pin_memory: bool) -> torch.Tensor:
    """``tensor`` copied to host memory with its strides (a dense one's: a transposed view stays transposed), so what
    comes back is laid out as what was saved: a compiled backward asserts the strides of what it saved (one H200,
    2026-12-04: SDPA's transposed query under compiled blocks failed there with contiguous host copies)."""
    host = torch.empty_like(tensor, device="cpu", pin_memory=pin_memory)
    host.copy_(tensor, non_blocking=pin_memory)
    return host


def _storage(tensor: torch.Tensor) -> int | None:
    """Where a tensor's data lives: a sharded parameter (DTensor, e.g. experts split by expert tensor parallelism)
    by its local shard; None for a tensor subclass without a plain storage."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def apply_activation_offload(layers: list[nn.Module]) -> ActivationOffload:
    """Offload what each of ``layers`` saves. Call after recompute is applied: the hooks must be entered before the
    checkpoint's (so the input it saves is offloaded) and left after it."""
    offload = ActivationOffload()
    contexts: list = []

    def enter(module, _args):
        # a recomputation in the backward runs the layer's forward again: its saved tensors belong to the
        # checkpoint there (no graph task runs outside the backward)
        in_backward = torch._C._current_graph_task_id() != -1
        context = (contextlib.nullcontext() if in_backward
                   else torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack))
        offload.layer, offload._weights = module, None
        context.__enter__()
        contexts.append(context)

    def leave(_module, _args, _output):
        contexts.pop().__exit__(None, None, None)

    for layer in layers:
        layer.register_forward_pre_hook(enter, prepend=True)
        layer.register_forward_hook(leave, always_call=True)  # a raising forward leaves too
    return offload
