"""Expert tensors in Hugging Face checkpoints <-> the native grouped expert parameters. Pure bookkeeping, no I/O.

Native models stack each layer's experts: ``...mlp.experts.{gate,up,down}_proj``, shape (E, out, in). Checkpoints
store them in one of two layouts, and both are read:

- ``per_expert``: one 2-D tensor per expert and projection, ``...mlp.experts.{e}.{gate,up,down}_proj.weight``
  (out, in): 3·E tensors per layer, the layout transformers 4.x writes for Qwen3-MoE.
- ``fused``: two 3-D tensors per layer, as transformers 5.x holds Qwen3-MoE (``Qwen3MoeExperts``):
  ``...mlp.experts.gate_up_proj`` (E, 2·F, D), the gate rows first and the up rows second along dim 1, and
  ``...mlp.experts.down_proj`` (E, D, F). Both keep nn.Linear's (out, in) orientation, like the native tensors.

Legend: E experts, F expert FFN width, D the experts' input width.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

EXPERT_LAYOUTS = ("fused", "per_expert")


@dataclass(frozen=True)
class FusedHalf:
    """A native gate (``index`` 0) or up (1) projection is this half of dim 1 of a fused ``gate_up_proj``."""

    index: int


@dataclass(frozen=True)
class Rearranged:
    """A native parameter is a fixed view of one whole HF tensor (gpt-oss): ``half`` 0 or 1, the even or odd
    entries of the HF tensor's last dim (gate and up interleaved there), None all of them; ``transposed``, the last
    two dims swapped (experts stored (in, out)). ``take`` reads the native tensor from the HF one."""

    half: int | None = None
    transposed: bool = False

    def take(self, hf: torch.Tensor) -> torch.Tensor:
        out = hf if self.half is None else hf[..., self.half::2]
        return (out.transpose(-1, -2) if self.transposed else out).contiguous()

    def hf_shape(self, native_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(native_shape)
        if self.transposed:
            shape[-1], shape[-2] = shape[-2], shape[-1]
        if self.half is not None:
            shape[-1] *= 2
        return tuple(shape)


@dataclass(frozen=True)
class Mxfp4Part:
    """The ``role`` ('blocks' or 'scales') tensor of an MXFP4-quantised (E, out, in) weight (common/mxfp4.py);
    ``half`` 0 or 1: the native parameter is its even or odd output rows (gpt-oss's interleaved gate and up), None:
    all of them."""

    role: str
    half: int | None = None


# Where one HF tensor sits in a native parameter: None, the whole of it; an int e, expert e's slice along dim 0
# (per-expert layout); a FusedHalf, part of a fused gate_up_proj; a Rearranged view of a whole tensor; one of the
# two tensors of an MXFP4 weight.
Part = None | int | FusedHalf | Rearranged | Mxfp4Part


def check_expert_layout(layout: str) -> str:
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout must be one of {EXPERT_LAYOUTS}, got {layout!r}")
    return layout


class ExpertKeyMap:
    def __init__(self, layers_prefix: str, *, default_layout: str = "per_expert") -> None:
        """``layers_prefix``: where the decoder layers live, e.g. ``model.layers``; ``default_layout``: what export
        writes unless told otherwise."""
        self.default_layout = check_expert_layout(default_layout)
        base = re.escape(layers_prefix) + r"\.\d+\.mlp\.experts"
        self._hf_expert = re.compile(rf"^({base})\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
        self._hf_gate_up = re.compile(rf"^({base})\.gate_up_proj$")
        self._native_expert = re.compile(rf"^({base})\.(gate_proj|up_proj|down_proj)$")

    def native_parts(self, hf_key: str) -> list[tuple[str, Part]]:
        """The native parameter(s) an HF tensor fills, and which part of each (see ``Part``). Any other name maps
        to itself, whole (a fused ``down_proj`` has its native name already)."""
        match = self._hf_expert.match(hf_key)
        if match:
            return [(f"{match.group(1)}.{match.group(3)}", int(match.group(2)))]
        match = self._hf_gate_up.match(hf_key)
        if match:
            return [(f"{match.group(1)}.gate_proj", FusedHalf(0)), (f"{match.group(1)}.up_proj", FusedHalf(1))]
        return [(hf_key, None)]

    def to_hf(self, named_tensors: Iterable[tuple[str, torch.Tensor]], num_experts: int,
              layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors (contiguous, dtype kept) for a stream of native (name, tensor) pairs, experts in ``layout``
        (default: this map's). A fused ``gate_up_proj`` is written once both of its halves have been seen."""
        layout = check_expert_layout(layout or self.default_layout)
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named_tensors:
            match = self._native_expert.match(name)
            if not match:
                yield name, tensor.contiguous()
                continue
            base, projection = match.groups()
            if tensor.dim() != 3 or tensor.shape[0] != num_experts:
                raise ValueError(f"{name}: expected {num_experts} experts in dim 0 of a 3-D tensor, "
                                 f"got shape {tuple(tensor.shape)}")
            if layout == "per_expert":
                yield from ((f"{base}.{e}.{projection}.weight", tensor[e].contiguous()) for e in range(num_experts))
            elif projection == "down_proj":
                yield name, tensor.contiguous()
            else:
                pair = halves.setdefault(base, {})
                pair[projection] = tensor
                if len(pair) == 2:
                    del halves[base]
                    yield f"{base}.gate_up_proj", torch.cat([pair["gate_proj"], pair["up_proj"]], dim=1)
        if halves:
            base, pair = next(iter(halves.items()))
            raise ValueError(f"{base}: {next(iter(pair))} has no partner to fuse into gate_up_proj")

    def expected_hf_shapes(self, model: nn.Module, num_experts: int,
                           layout: str | None = None) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name of a checkpoint of ``model`` (build it on the meta device) with its shape."""
        named = ((name, param.detach()) for name, param in model.named_parameters())
        return {hf_name: tuple(piece.shape) for hf_name, piece in self.to_hf(named, num_experts, layout)}
