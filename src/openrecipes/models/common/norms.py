"""RMSNorm, computed in fp32 (or wider) whatever the activation dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = w · x / rms(x). ``zero_centered`` stores w - 1, so y = (1 + w) · x / rms(x) and w starts at 0."""

    def __init__(self, dim: int, *, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            # one fused kernel on CUDA; statistics in fp32 (fp64 stays fp64), one rounding to the input dtype
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        compute_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16/fp16, fp64 stays fp64
        x_wide = x.to(compute_dtype)
        normed = x_wide * torch.rsqrt(x_wide.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return ((1.0 + self.weight.to(compute_dtype)) * normed).to(x.dtype)
