"""FP8 matrix products for training, row-wise scaled (Hopper's FP8 tensor cores run at twice the bf16 rate).

Definition (every GEMM, forward and both backward products): each operand is scaled along the dimension the product
sums over, one fp32 scale per row of the other dimension, ``s = amax(|row|) / 448`` (e4m3's largest finite value),
and rounded to ``float8_e4m3fn``; the product sums ``(q_a · s_a)(q_b · s_b)`` in fp32 and rounds the result to the
output dtype. ``fp8_linear`` does this for ``x @ W^T`` (a dense projection), ``fp8_grouped_linear`` for the routed
experts' products over rows sorted by expert. Their weight gradient sums each expert's rows on their own; its
operands take one scale per column over all the rows (constant within every expert's rows, as the definition asks;
e4m3's exponent keeps an expert whose values are far below another's at full relative precision down to 2^-15 of
the column's largest), so the scales come from one reduction and no expert boundary is read on the host. The weights and their gradients stay in their own dtype: only the products' inputs are
rounded, so the optimizer and its master weights are unchanged (torchao's float8 "rowwise" recipe and DeepSeek-V3's
fine-grained FP8 scale the same way, at other granularities).

On CUDA the products run in ``torch._scaled_mm`` and ``torch._scaled_grouped_mm``; elsewhere (and for shapes those
kernels refuse) ``emulate`` computes the same definition with dequantized fp32 operands, which is also the reference
the component test holds the kernels to.
"""

from __future__ import annotations

import torch
from torch import nn

FP8_EXPERTS = "fp8"  # GroupedExperts.backend once the recipe's fp8 section puts the routed experts in FP8
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
_AMAX_FLOOR = 1e-12  # an all-zero row keeps a finite scale (its values quantize to 0 whatever the scale)
_ALIGN = 16  # _scaled_mm and _scaled_grouped_mm need every dimension of a product to be a multiple of 16 bytes


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` rounded to e4m3 with one fp32 scale per slice along ``dim`` (the summed dimension); the scale keeps
    ``dim`` as size 1, so ``q.float() * scale`` is the dequantized tensor. ``q`` is contiguous whatever x's strides:
    a transposed operand is transposed in the same pass (fused where compiled)."""
    scale = _scale(x.detach().abs().amax(dim=dim, keepdim=True).float())
    return _round(x, scale).contiguous(), scale


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=_AMAX_FLOOR) / E4M3_MAX


def _round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in e4m3, clamped first: rounding can carry a row's largest value just past e4m3's range."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


_compiled: dict[str, object] = {}


def _fused(fn):
    """``fn`` compiled on CUDA (its amax, division, clamp and cast fused into few passes over the tensor); eager
    elsewhere and inside a graph being compiled already."""
    def call(x, *args):
        if not x.is_cuda or torch.compiler.is_compiling():
            return fn(x, *args)
        if fn.__name__ not in _compiled:
            _compiled[fn.__name__] = torch.compile(fn, dynamic=True)
        return _compiled[fn.__name__](x, *args)
    return call


def quantize_columns_padded(x_RC: torch.Tensor, dest_R: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by group, scaled along the rows: one scale per column over every row (constant within each
    group, so each group's product may sum its rows), returned transposed, (C, width) row-major e4m3, with row r at
    column ``dest_R[r]`` and zeros in the padding between groups; the scale (C,). On CUDA only compiled
    (``_quantize_columns_padded``): eager ``index_copy`` has no e4m3 kernel there."""
    scale_C = _scale(x_RC.detach().abs().amax(dim=0).float())
    q_RC = _round(x_RC, scale_C)
    padded_WC = q_RC.new_zeros(width, x_RC.shape[1]).index_copy(0, dest_R, q_RC)
    return padded_WC.t().contiguous(), scale_C


_quantize = _fused(quantize)
_quantize_columns_padded = _fused(quantize_columns_padded)


def _mm(a_MK: torch.Tensor, b_NK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b^T`` with both operands scaled along K: the definition above, one product."""
    qa, sa = _quantize(a_MK, 1)
    qb, sb = _quantize(b_NK, 1)
    if a_MK.is_cuda and all(n % _ALIGN == 0 for n in (*a_MK.shape, b_NK.shape[0])):
        # column-major second operand (``qb.t()`` of a row-major (N, K)), scales (M, 1) and (1, N)
        return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)
    return emulate(qa, sa, qb, sb).to(out_dtype)


def emulate(qa_MK: torch.Tensor, sa_M1: torch.Tensor, qb_NK: torch.Tensor, sb_N1: torch.Tensor) -> torch.Tensor:
    """The reference product: dequantized fp32 operands, fp32 sums."""
    return (qa_MK.float() * sa_M1) @ (qb_NK.float() * sb_N1).t()


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MK, weight_NK)
        return _mm(x_MK, weight_NK, x_MK.dtype)

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        x_MK, weight_NK = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()
        grad_x = _mm(grad_MN, weight_NK.t(), x_MK.dtype)  # sums over N
        grad_w = _mm(grad_MN.t(), x_MK.t(), weight_NK.dtype)  # sums over M
        return grad_x, grad_w


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with its three products in FP8 (row-wise); any leading dimensions; the bias added in x's dtype."""
    out = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _group_ids(counts_E: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(counts_E.numel(), device=counts_E.device), counts_E,
                                   output_size=rows)


def _grouped_kernels(x: torch.Tensor, out_dtype: torch.dtype, *dims: int) -> bool:
    """Whether torch._scaled_grouped_mm takes this product: bf16 out (the grouped kernel's only output dtype) and
    every fixed dimension a multiple of 16. Decided from shapes alone, so no host sync: the experts' row counts are
    ragged, which the forward and input-gradient products take (rows are their M dimension) and the weight gradient
    takes padded (its groups are along K, where each group must start 16 bytes apart)."""
    return (x.is_cuda and hasattr(torch, "_scaled_grouped_mm") and out_dtype == torch.bfloat16
            and all(n % _ALIGN == 0 for n in dims))


def _padding(counts_E: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where row r lands when every expert's rows start at a multiple of 16: the destinations (R,), the padded
    groups' end offsets (E,) int32, and a width that holds them whatever the counts (so the shape is static)."""
    padded_E = (counts_E + _ALIGN - 1) // _ALIGN * _ALIGN
    end_E = torch.cumsum(padded_E, dim=0)
    shift_E = (end_E - padded_E) - (torch.cumsum(counts_E, dim=0) - counts_E)
    dest_R = torch.arange(rows, device=counts_E.device) + shift_E[_group_ids(counts_E, rows)]
    width = -(-(rows + (_ALIGN - 1) * counts_E.numel()) // _ALIGN) * _ALIGN
    return dest_R, end_E.to(torch.int32), width


def _grouped_forward(x_RI: torch.Tensor, weight_EOI: torch.Tensor, counts_E: torch.Tensor,
                     offsets_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y[r] = W[e(r)] x[r], both scaled along I."""
    qx, sx = _quantize(x_RI, 1)
    qw, sw = _quantize(weight_EOI, 2)
    if _grouped_kernels(x_RI, out_dtype, weight_EOI.shape[1], weight_EOI.shape[2]):
        return torch._scaled_grouped_mm(qx, qw.transpose(-2, -1), sx.squeeze(1), sw.squeeze(2), offs=offsets_E,
                                        out_dtype=out_dtype)
    group = _group_ids(counts_E, x_RI.shape[0])
    return torch.bmm((qx.float() * sx)[:, None], (qw.float() * sw)[group].transpose(-2, -1))[:, 0].to(out_dtype)


def _grouped_weight_grad(grad_RO: torch.Tensor, x_RI: torch.Tensor, counts_E: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """dW[e] = sum over e's rows of grad[r]^T x[r], both scaled along the rows (one scale per column)."""
    experts, (rows, out_dim), in_dim = counts_E.numel(), grad_RO.shape, x_RI.shape[1]
    if _grouped_kernels(x_RI, out_dtype, out_dim, in_dim):
        dest_R, ends_E, width = _padding(counts_E, rows)
        qg_OW, sg_O = _quantize_columns_padded(grad_RO, dest_R, width)
        qx_IW, sx_I = _quantize_columns_padded(x_RI, dest_R, width)
        # one scale per (expert, row of each operand), expert-major: the shared scales repeated per expert
        return torch._scaled_grouped_mm(qg_OW, qx_IW.t(), sg_O.repeat(experts), sx_I.repeat(experts), offs=ends_E,
                                        out_dtype=out_dtype)
    qg, sg = quantize(grad_RO, 0)
    qx, sx = quantize(x_RI, 0)
    dequant_g, dequant_x = qg.float() * sg, qx.float() * sx
    out = dequant_g.new_zeros(experts, out_dim, in_dim)
    for e, (g, x) in enumerate(zip(dequant_g.split(counts_E.tolist()), dequant_x.split(counts_E.tolist()))):
        out[e] = g.t() @ x
    return out.to(out_dtype)


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI, weight_EOI, counts_E, offsets_E):
        ctx.save_for_backward(x_RI, weight_EOI, counts_E, offsets_E)
        return _grouped_forward(x_RI, weight_EOI, counts_E, offsets_E, x_RI.dtype)

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, weight_EOI, counts_E, offsets_E = ctx.saved_tensors
        grad_RO = grad_RO.contiguous()
        # dx[r] = W[e(r)]^T grad[r]: the forward's product with the weight transposed, scaled along O
        grad_x = _grouped_forward(grad_RO, weight_EOI.transpose(-2, -1), counts_E, offsets_E, x_RI.dtype)
        grad_w = _grouped_weight_grad(grad_RO, x_RI, counts_E, weight_EOI.dtype)
        return grad_x, grad_w, None, None


def fp8_grouped_linear(x_RI: torch.Tensor, weight_EOI: torch.Tensor, counts_E: torch.Tensor,
                       offsets_E: torch.Tensor | None = None) -> torch.Tensor:
    """``moe.grouped_linear`` in FP8: rows sorted by expert, ``counts_E`` rows each; returns (R, O)."""
    if offsets_E is None:
        offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    return _Fp8GroupedLinear.apply(x_RI, weight_EOI, counts_E, offsets_E)


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose product runs in FP8 (same parameters and names; ``to_fp8`` turns a Linear into one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


def to_fp8(module: nn.Linear) -> None:
    """Turn ``module`` into an Fp8Linear in place: its parameters, hooks and place in the model stay."""
    if type(module) is not nn.Linear:
        raise TypeError(f"only a plain nn.Linear turns into an Fp8Linear, got {type(module).__name__}")
    module.__class__ = Fp8Linear
