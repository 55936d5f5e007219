"""Rotary position embeddings, computed from position ids on the fly (no buffers: meta-device friendly).

Two pairings: ``half`` rotates dimension i with i + D/2 (Qwen, Llama); ``adjacent`` rotates 2i with 2i + 1.
"""

from __future__ import annotations

import torch

from openrecipes.models.common.rope_scaling import RopeScaling

PLAIN_ROPE = RopeScaling()


def rope_angles(position_ids: torch.Tensor, head_dim: int, theta: float,
                scaling: RopeScaling = PLAIN_ROPE) -> torch.Tensor:
    """Angles of shape (B, T, head_dim / 2), in fp32; ``scaling``: a checkpoint's scaled RoPE (rope_scaling.py),
    whose cos/sin factor the caller applies."""
    return position_ids[..., None].float() * scaling.inv_freq(head_dim, theta, position_ids.device, position_ids)


def apply_rope(x_BHTD: torch.Tensor, angles_BTF: torch.Tensor, *, pairing: str = "half") -> torch.Tensor:
    """Rotate queries or keys of shape (B, H, T, D) by ``angles`` of shape (B, T, D/2)."""
    if pairing == "half":
        doubled = torch.cat((angles_BTF, angles_BTF), dim=-1)[:, None]
        cos, sin = doubled.cos().to(x_BHTD.dtype), doubled.sin().to(x_BHTD.dtype)
        first, second = x_BHTD.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
        return x_BHTD * cos + rotated * sin
    if pairing == "adjacent":
        cos = angles_BTF.cos()[:, None].to(x_BHTD.dtype)
        sin = angles_BTF.sin()[:, None].to(x_BHTD.dtype)
        even, odd = x_BHTD[..., 0::2], x_BHTD[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    raise ValueError(f"unknown RoPE pairing {pairing!r}; expected 'half' or 'adjacent'")


def apply_partial_rope(x_BHTD: torch.Tensor, angles_BTF: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dimensions of each head (rotate-half pairing within them); keep the rest
    (GLM-4.5's and Qwen3.5's partial rotary: ``angles`` hold the rotated width's frequencies alone)."""
    if rotary_dim == x_BHTD.shape[-1]:
        return apply_rope(x_BHTD, angles_BTF)
    rotated, kept = x_BHTD.split([rotary_dim, x_BHTD.shape[-1] - rotary_dim], dim=-1)
    return torch.cat((apply_rope(rotated, angles_BTF), kept), dim=-1)
