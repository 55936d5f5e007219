"""MXFP4 weights (OCP microscaling FP4), as gpt-oss checkpoints store their experts, dequantized on import.

A quantised (..., O, I) weight is two tensors: ``blocks`` (..., O, I/32, 16) uint8, two FP4 (E2M1) codes per byte,
the low nibble first, and ``scales`` (..., O, I/32) uint8, one power-of-two exponent per 32 values, biased by 127.
Value = E2M1(code) · 2^(scale - 127). Every such value is exact in bf16 and fp32 (3 significant bits, exponents in
range), so the result does not depend on the dtype asked for beyond its range. Export writes the dequantized
tensors (bf16 or fp32), never MXFP4.
"""

from __future__ import annotations

import torch

# E2M1 codes 0..15: sign bit 3, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
                     ) -> torch.Tensor:
    """(..., O, G, 16) uint8 blocks and (..., O, G) uint8 scales -> the (..., O, G·32) weight in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         "(expected blocks = scales' shape + (16,))")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = table[codes].flatten(-2)                                 # (..., O, G, 32)
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return out.flatten(-2).to(dtype)
