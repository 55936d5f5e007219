"""An FP32 master stored as a bf16 value plus an int16 remainder, rebuilt bit for bit.

The fp32 bit pattern splits into its high 16 bits (exactly a bf16 number) and its low 16 bits. Storing the high
half rounded to nearest (so the bf16 param the model computes with is the best bf16 approximation of the
master) makes the low half a signed offset: when the low half is >= 0x8000 the high half is bumped by one and the
remainder stored as low - 0x10000. Rebuilding adds them back: (high << 16) + remainder.
"""

from __future__ import annotations

import torch


def split_master(master_fp32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 param rounded to nearest, int16 remainder)."""
    bits = master_fp32.contiguous().view(torch.int32)
    low = bits & 0xFFFF
    round_up = low >= 0x8000
    high = (bits >> 16) + round_up.to(torch.int32)
    remainder = low - round_up.to(torch.int32) * 0x10000
    return high.to(torch.int16).view(torch.bfloat16), remainder.to(torch.int16)


def join_master(param_bf16: torch.Tensor, remainder_int16: torch.Tensor) -> torch.Tensor:
    """(bf16 param, int16 remainder) -> the fp32 master they were split from, bitwise."""
    high = param_bf16.contiguous().view(torch.int16).to(torch.int32)
    bits = (high << 16) + remainder_int16.to(torch.int32)
    return bits.view(torch.float32)
