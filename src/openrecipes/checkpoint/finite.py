"""Weights read from a checkpoint are finite: a NaN or inf would be trained from, merged or exported as if it were a
weight, and every later step computed from it is NaN too. Each reader checks the tensors where it reads them
(``safetensors_io.HFCheckpoint`` for Hugging Face files, ``safe_load.load_dcp`` for DCP checkpoints, the adapter
reader for LoRA factors) and names the file and the tensor in one line."""

from __future__ import annotations

from typing import Any, Iterator

import torch

# elements checked at a time, so the isfinite mask stays small beside a large expert tensor
_CHECK_ELEMENTS = 1 << 24


def all_finite(tensor: torch.Tensor) -> bool:
    """True unless a floating-point ``tensor`` (a DTensor: this rank's shard) holds NaN or inf; other dtypes pass."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if not tensor.is_floating_point():
        return True
    if tensor.dim() == 0 or tensor.numel() == 0:
        return bool(torch.isfinite(tensor).all())
    rows = max(1, _CHECK_ELEMENTS // max(1, tensor[0].numel()))
    return all(bool(torch.isfinite(part).all()) for part in tensor.detach().split(rows))


def nonfinite_message(source: Any, name: str) -> str:
    """The one line naming the file (or directory) and the tensor that holds NaN or inf."""
    return f"{source}: tensor {name!r} holds NaN or inf values; only finite weights are read"


def require_finite(tensor: torch.Tensor, name: str, source: Any) -> torch.Tensor:
    """``tensor`` itself, or a ValueError naming ``source`` and ``name`` when it holds NaN or inf."""
    if not all_finite(tensor):
        raise ValueError(nonfinite_message(source, name))
    return tensor


def flat_tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested state (dicts and lists), named by its dotted path as DCP names it."""
    if torch.is_tensor(state):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from flat_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from flat_tensors(value, f"{prefix}.{index}" if prefix else str(index))


def first_nonfinite(state: Any) -> str | None:
    """The dotted name of the first floating-point tensor of ``state`` holding NaN or inf, or None."""
    return next((name for name, tensor in flat_tensors(state) if not all_finite(tensor)), None)
