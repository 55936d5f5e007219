"""Expert parallelism: each of the ep ranks of an expert group holds E/ep experts; token copies travel to the rank
of their expert and back with all-to-all.

Legend: T local tokens, K experts per token, R = T·K routed copies, E experts in all, L = E/ep local experts,
S source ranks of the expert group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from openrecipes.models.common.moe import (
    GroupedExperts,
    Routing,
    _GatherTokenCopies,
    _PermuteRows,
    sort_by_expert,
    swiglu_experts,
)


class _AllToAll(torch.autograd.Function):
    """Rows to and from every rank of ``group``; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return out, None, None, None


def _segments_to_expert_major(counts_SL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows arrive ordered (source rank, local expert); return the permutation to (local expert, source) order
    and its inverse."""
    counts = counts_SL.flatten()
    starts_SL = (torch.cumsum(counts, 0) - counts).view_as(counts_SL)
    counts_LS, starts_LS = counts_SL.t().flatten(), starts_SL.t().flatten()
    out_starts = torch.cumsum(counts_LS, 0) - counts_LS
    total = int(counts.sum())
    index = torch.repeat_interleave(starts_LS - out_starts, counts_LS, output_size=total)
    index = index + torch.arange(total, device=counts.device)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(total, device=counts.device)
    return index, inverse


class ExpertParallelDispatcher:
    def __init__(self, *, group, ep_size: int, num_experts: int, compute_dtype: torch.dtype | None) -> None:
        self.group = group
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.local_experts = num_experts // ep_size
        self.compute_dtype = compute_dtype

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        tokens, top_k = routing.experts_TK.shape
        order_R, inverse_R, counts_E = sort_by_expert(routing.experts_TK, self.num_experts)
        x_RD = _GatherTokenCopies.apply(x_TD, order_R, inverse_R, top_k)  # grouped by destination rank
        recv_counts = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts, counts_E, group=self.group)   # L counts from each source
        counts_SL = recv_counts.view(self.ep_size, self.local_experts)
        send_splits = counts_E.view(self.ep_size, self.local_experts).sum(1).tolist()
        recv_splits = counts_SL.sum(1).tolist()
        received = _AllToAll.apply(x_RD, recv_splits, send_splits, self.group)
        index, inverse = _segments_to_expert_major(counts_SL)
        weights = [_local(w) for w in (experts.gate_proj, experts.up_proj, experts.down_proj)]
        if self.compute_dtype is not None:
            weights = [w.to(self.compute_dtype) for w in weights]
        out = swiglu_experts(_PermuteRows.apply(received, index, inverse), counts_SL.sum(0), *weights)
        returned = _AllToAll.apply(_PermuteRows.apply(out, inverse, index), send_splits, recv_splits, self.group)
        out_TKD = _PermuteRows.apply(returned, inverse_R, order_R).view(tokens, top_k, -1)
        return (out_TKD * routing.weights_TK.unsqueeze(-1).to(out_TKD.dtype)).sum(dim=1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def apply_expert_parallel(moe_blocks: list[nn.Module], expert_mesh, *, compute_dtype: torch.dtype | None) -> None:
    """Keep this rank's E/ep experts of every block as DTensors (Replicate over edp, Shard(0) over ep) and route
    through all-to-all. On the meta device (the engine's path) the slices are materialised and initialised later;
    with real tensors the full expert tensors must hold the same values on every rank beforehand."""
    ep_size = expert_mesh["ep"].size()
    ep_rank = expert_mesh["ep"].get_local_rank()
    group = expert_mesh["ep"].get_group()
    for block in moe_blocks:
        experts: GroupedExperts = block.experts
        total = experts.num_experts
        if total % ep_size:
            raise ValueError(f"layout.ep={ep_size} does not divide the {total} experts")
        local = total // ep_size
        for name in ("gate_proj", "up_proj", "down_proj"):
            full = getattr(experts, name)
            piece = full.detach()[ep_rank * local:(ep_rank + 1) * local].clone()
            sharded = DTensor.from_local(piece, expert_mesh, [Replicate(), Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        experts.num_experts = local
        block.token_dispatcher = ExpertParallelDispatcher(group=group, ep_size=ep_size, num_experts=total,
                                                          compute_dtype=compute_dtype)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """In module order, the same on every rank: collectives issued per parameter must pair up across ranks (a set
    would iterate in id order, which differs between processes)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


def all_reduce_expert_grads(model: nn.Module, expert_mesh) -> None:
    """Sum expert gradients over the expert-data-parallel ranks that hold the same experts."""
    if expert_mesh is None or expert_mesh["edp"].size() == 1:
        return
    group = expert_mesh["edp"].get_group()
    for param in expert_parameters(model):
        if param.grad is not None:
            dist.all_reduce(_local(param.grad), group=group)
