"""One-pass AdamW update on CUDA (Triton): read param (+ remainder or fp32 master), fp32 gradient and moments
once, write them once. The arithmetic is ``adam.adam_math``'s, element by element, in fp32.

The gradient's scale (the clip factor) and whether to skip the update (a non-finite step) are read by the kernel
from device tensors, so the host launches the update without waiting for the gradient norm."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the eager path is used
    triton = None

BLOCK = 2048

if triton is not None:

    @triton.jit
    def _adam_kernel(param_ptr, master_ptr, remainder_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, n_elements,
                     lr, beta1, beta2, eps, decay_factor, step_size, inv_sqrt_bc2, grad_scale_ptr, skip_ptr,
                     MODE: tl.constexpr, MOMENTS_BF16: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        # MODE 0: fp32 params are the masters; 1: explicit fp32 master + bf16 param; 2: bf16 param + int16 remainder
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_elements
        if HAS_SKIP:  # a skipped step reads and writes nothing: every load and store is masked off
            mask = mask & (tl.load(skip_ptr) == 0)
        grad_scale = tl.load(grad_scale_ptr)
        if MODE == 0:
            master = tl.load(param_ptr + offsets, mask=mask)
        elif MODE == 1:
            master = tl.load(master_ptr + offsets, mask=mask)
        else:
            high = tl.load(param_ptr + offsets, mask=mask).to(tl.int32)  # bf16 bits viewed as int16
            low = tl.load(remainder_ptr + offsets, mask=mask).to(tl.int32)
            master = ((high << 16) + low).to(tl.float32, bitcast=True)
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * grad_scale
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
        master = master * decay_factor
        exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) * inv_sqrt_bc2 + eps
        master = master - step_size * (exp_avg / denom)
        if MOMENTS_BF16:
            tl.store(exp_avg_ptr + offsets, exp_avg.to(tl.bfloat16), mask=mask)
            tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(tl.bfloat16), mask=mask)
        else:
            tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
            tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        if MODE == 0:
            tl.store(param_ptr + offsets, master, mask=mask)
        elif MODE == 1:
            tl.store(master_ptr + offsets, master, mask=mask)
            tl.store(param_ptr + offsets, master.to(tl.bfloat16), mask=mask)
        else:
            bits = master.to(tl.int32, bitcast=True)
            low = bits & 0xFFFF
            round_up = (low >= 0x8000).to(tl.int32)
            tl.store(param_ptr + offsets, ((bits >> 16) + round_up).to(tl.int16), mask=mask)
            tl.store(remainder_ptr + offsets, (low - round_up * 0x10000).to(tl.int16), mask=mask)


def available(tensor: torch.Tensor) -> bool:
    return triton is not None and tensor.is_cuda


def fused_adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                      master: torch.Tensor | None, remainder: torch.Tensor | None, step: int, lr: float, beta1: float,
                      beta2: float, eps: float, weight_decay: float, grad_scale: torch.Tensor | float = 1.0,
                      skip: torch.Tensor | None = None) -> None:
    """Update in place; ``param`` is fp32 (MODE 0), or bf16 with ``master`` (MODE 1) or ``remainder`` (MODE 2).
    ``grad_scale``: an fp32 scalar tensor on the device (a float is made one); ``skip``: a bool scalar tensor on
    the device, true to leave everything as it is."""
    if not torch.is_tensor(grad_scale):
        grad_scale = torch.full((), grad_scale, dtype=torch.float32, device=param.device)
    mode = 0 if param.dtype == torch.float32 else (1 if master is not None else 2)
    n = param.numel()
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    param_arg = param.view(torch.int16) if mode == 2 else param
    grid = (triton.cdiv(n, BLOCK),)
    _adam_kernel[grid](param_arg, master if master is not None else param, remainder if remainder is not None else param_arg,
                       grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps, 1.0 - lr * weight_decay,
                       lr / bias_correction1, 1.0 / bias_correction2 ** 0.5, grad_scale,
                       # bool read as its byte: Triton's loads of i1 pointers are less portable than of u8
                       skip.view(torch.uint8) if skip is not None else grad_scale, MODE=mode,
                       MOMENTS_BF16=exp_avg.dtype == torch.bfloat16, HAS_SKIP=skip is not None, BLOCK_SIZE=BLOCK)
