"""Seeded initialisation that gives every tensor the same values however the model is split.

Pure PyTorch: a sharded tensor (a pipeline stage's or an expert-parallel rank's) is filled by the filler
``openrecipes.parallel.init`` passes to ``init_weights``; it draws the same whole-tensor values and keeps its slice.
"""

from __future__ import annotations

import zlib
from typing import Callable, Protocol

import torch
from torch import nn


class SeededFill(Protocol):
    def __call__(self, param: torch.Tensor, name: str, *, seed: int, std: float) -> None: ...


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def seeded_normal(shape: torch.Size | tuple[int, ...], name: str, *, seed: int, std: float,
                  device: torch.device) -> torch.Tensor:
    """N(0, std) values of a whole tensor from a generator seeded by (seed, name), in fp32."""
    return torch.randn(shape, generator=_generator(name, seed, device), dtype=torch.float32, device=device) * std


def seeded_uniform(shape: torch.Size | tuple[int, ...], name: str, *, seed: int, bound: float,
                   device: torch.device) -> torch.Tensor:
    """U(-bound, bound) values of a whole tensor from a generator seeded by (seed, name), in fp32."""
    values = torch.rand(shape, generator=_generator(name, seed, device), dtype=torch.float32, device=device)
    return values * (2 * bound) - bound


@torch.no_grad()
def fill_seeded_normal_(param: torch.Tensor, name: str, *, seed: int, std: float) -> None:
    """Fill a whole (unsharded) ``param`` in place with its seeded N(0, std) values."""
    param.copy_(seeded_normal(param.shape, name, seed=seed, std=std, device=param.device))


def build_on_meta(make: Callable[[], nn.Module], *, device: str | torch.device, dtype: torch.dtype,
                  seed: int | None) -> nn.Module:
    """Build on the meta device, materialise on ``device`` in ``dtype`` and initialise (``init_weights``);
    ``seed=None`` leaves memory uninitialised, and ``device="meta"`` returns the model unmaterialised."""
    with torch.device("meta"):
        model = make()
    model = model.to(dtype)  # on the meta device, so the weights are allocated once, in their own dtype
    if str(device) == "meta":
        return model
    model = model.to_empty(device=device)
    if seed is not None:
        model.init_weights(seed=seed)
    return model
