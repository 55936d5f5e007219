"""Differentiable collectives shared by the parallel layouts."""

from __future__ import annotations

import torch
import torch.distributed as dist


class GatherAlongDim(torch.autograd.Function):
    """Every rank's slice along ``dim`` -> the whole tensor on every rank. The backward returns this rank's slice
    of the gradient, first summed over the group when ``sum_grads`` (each rank's consumers read the whole tensor
    and produced only part of its gradient) and as is when the consumers already summed it."""

    @staticmethod
    def forward(ctx, x, dim: int, group, rank: int, size: int, sum_grads: bool):
        ctx.dim, ctx.group, ctx.rank, ctx.size, ctx.sum_grads = dim, group, rank, size, sum_grads
        pieces = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grads:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None, None
