"""gpt-oss tensor names: transformers' own, except the experts, held here as three (E, out, in) projections with
their biases (``common/moe.py`` ``GroupedExperts``) where transformers holds

- ``mlp.experts.gate_up_proj`` (E, D, 2F): stored (in, out), the gate and up columns interleaved (gate even, up odd);
- ``mlp.experts.gate_up_proj_bias`` (E, 2F): interleaved alike;
- ``mlp.experts.down_proj`` (E, F, D): stored (in, out); ``mlp.experts.down_proj_bias`` (E, D), as here.

Published checkpoints store the expert matrices as MXFP4, ``{gate_up,down}_proj_{blocks,scales}`` over (E, out, in)
(``common/mxfp4.py``); import dequantizes them, and export writes the unquantized tensors (experts fused, as
transformers holds them: the only layout transformers' gpt-oss has).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch

from openrecipes.models.common.hf_experts import Mxfp4Part, Part, Rearranged

_EXPERTS = r"^(model\.layers\.\d+\.mlp\.experts)\."
_HF_MAP: dict[str, list[tuple[str, Part]]] = {
    "gate_up_proj": [("gate_proj", Rearranged(half=0, transposed=True)),
                     ("up_proj", Rearranged(half=1, transposed=True))],
    "gate_up_proj_bias": [("gate_proj_bias", Rearranged(half=0)), ("up_proj_bias", Rearranged(half=1))],
    "down_proj": [("down_proj", Rearranged(transposed=True))],
    "gate_up_proj_blocks": [("gate_proj", Mxfp4Part("blocks", 0)), ("up_proj", Mxfp4Part("blocks", 1))],
    "gate_up_proj_scales": [("gate_proj", Mxfp4Part("scales", 0)), ("up_proj", Mxfp4Part("scales", 1))],
    "down_proj_blocks": [("down_proj", Mxfp4Part("blocks"))],
    "down_proj_scales": [("down_proj", Mxfp4Part("scales"))],
}
_HF_EXPERT = re.compile(_EXPERTS + rf"({'|'.join(_HF_MAP)})$")
_NATIVE_EXPERT = re.compile(_EXPERTS + r"(gate_proj|up_proj|down_proj|gate_proj_bias|up_proj_bias)$")


def native_parts(hf_key: str) -> list[tuple[str, Part]]:
    """The native parameter(s) an HF tensor fills and how (``common/hf_experts.Part``); other names map to
    themselves, whole (``down_proj_bias`` among them)."""
    match = _HF_EXPERT.match(hf_key)
    if match is None:
        return [(hf_key, None)]
    return [(f"{match.group(1)}.{name}", part) for name, part in _HF_MAP[match.group(2)]]


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(..., F) gate and up -> (..., 2F) with gate on the even entries and up on the odd ones."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def to_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], config: Any,
          expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors for native ones; the experts fused and interleaved as transformers holds them."""
    if expert_layout not in (None, "fused"):
        raise ValueError(f"expert layout {expert_layout!r} is not supported for gpt-oss: transformers' gpt-oss has "
                         "only the fused layout")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        match = _NATIVE_EXPERT.match(name)
        if match is None:
            yield name, tensor.contiguous()
            continue
        base, kind = match.groups()
        if kind == "down_proj":
            yield f"{base}.down_proj", tensor.transpose(-1, -2).contiguous()
            continue
        held = pending.setdefault(base, {})
        held[kind] = tensor
        if "gate_proj" in held and "up_proj" in held:
            yield f"{base}.gate_up_proj", _interleave(held.pop("gate_proj").transpose(-1, -2),
                                                      held.pop("up_proj").transpose(-1, -2)).contiguous()
        if "gate_proj_bias" in held and "up_proj_bias" in held:
            yield f"{base}.gate_up_proj_bias", _interleave(held.pop("gate_proj_bias"), held.pop("up_proj_bias"))
    left = {f"{base}.{kind}" for base, held in pending.items() for kind in held}
    if left:
        raise ValueError(f"{sorted(left)[0]}: the gate or up tensor has no partner to fuse into gate_up_proj")
