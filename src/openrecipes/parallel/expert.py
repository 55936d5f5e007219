"""Expert parallelism: each of the ep ranks of an expert group holds E/ep experts; token copies travel to the rank
of their expert and back with all-to-all. With expert tensor parallelism (etp > 1) the etp ranks of a group split each
of those experts' FFN: they gather the copies all of them received, each applies its FFN slice, and the partial outputs
are summed back to the rank that received each copy (reduce-scatter).

Legend: T local tokens, K experts per token, R = T·K routed copies, E experts in all, L = E/ep local experts,
S source ranks of the expert group, P etp peers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from openrecipes.models.common.lora import ExpertAdapter
from openrecipes.models.common.moe import (
    GroupedExperts,
    Routing,
    GatherTokenCopies,
    PermuteRows,
    sort_by_expert,
    swiglu_experts,
)


class _AllToAll(torch.autograd.Function):
    """Rows to and from every rank of ``group``; the backward sends the gradients back the same way. ``zeroed``: the
    receiving buffers start at zero, for an exchange that may deliver nothing (a fake process group, whose
    uninitialised buffers can hold NaN bit patterns on a GPU); a real exchange overwrites every row, so skips it."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, zeroed: bool = False):
        ctx.splits, ctx.group, ctx.zeroed = (out_splits, in_splits), group, zeroed
        out = (x.new_zeros if zeroed else x.new_empty)((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        out = (grad.new_zeros if ctx.zeroed else grad.new_empty)((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return out, None, None, None, None


def _gather_padded(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every peer's rows (``sizes[i]`` from peer i), concatenated in peer order."""
    width = max(sizes)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[:x.shape[0]] = x
    out = x.new_empty((len(sizes) * width, *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return torch.cat([out[i * width:i * width + n] for i, n in enumerate(sizes)])


def _reduce_scatter_padded(x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """Rows concatenated in peer order (``sizes``), summed over the peers; each keeps its own rows."""
    width = max(sizes)
    padded = x.new_zeros((len(sizes) * width, *x.shape[1:]))
    start = 0
    for i, n in enumerate(sizes):
        padded[i * width:i * width + n] = x[start:start + n]
        start += n
    out = x.new_empty((width, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out[:sizes[rank]]


class _GatherFromPeers(torch.autograd.Function):
    """Forward: all peers' rows. Backward: each row's gradient summed over the peers, back to its owner."""

    @staticmethod
    def forward(ctx, x, sizes: list[int], rank: int, group):
        ctx.args = (sizes, rank, group)
        return _gather_padded(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_padded(grad, *ctx.args), None, None, None


class _SumToOwners(torch.autograd.Function):
    """Forward: partial rows summed over the peers, each owner keeping its rows. Backward: the owners' gradients
    gathered to every peer (each peer's partial contributed to all of them)."""

    @staticmethod
    def forward(ctx, x, sizes: list[int], rank: int, group):
        ctx.args = (sizes, group)
        return _reduce_scatter_padded(x, sizes, rank, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, group = ctx.args
        return _gather_padded(grad, sizes, group), None, None, None


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
    def __init__(self, *, group, ep_size: int, num_experts: int, compute_dtype: torch.dtype | None,
                 etp_group=None, etp_size: int = 1, etp_rank: int = 0) -> None:
        self.group = group
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.local_experts = num_experts // ep_size
        self.compute_dtype = compute_dtype
        self.etp_group, self.etp_size, self.etp_rank = etp_group, etp_size, etp_rank
        self.ep_rank = dist.get_rank(group)
        self.mirrored = False  # ``assume_mirrored_routing``: the counts are this rank's own, not exchanged
        self.received_rows: list[int] = []  # with ``mirrored``: rows each forward received (what the tool reports)

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        tokens, top_k = routing.experts_TK.shape
        order_R, inverse_R, counts_E = sort_by_expert(routing.experts_TK, self.num_experts)
        x_RD = GatherTokenCopies.apply(x_TD, order_R, inverse_R, top_k)  # grouped by destination rank
        counts_SL = self._received_counts(counts_E)
        send_splits = counts_E.view(self.ep_size, self.local_experts).sum(1).tolist()
        recv_splits = counts_SL.sum(1).tolist()
        received = _AllToAll.apply(x_RD, recv_splits, send_splits, self.group, self.mirrored)
        out = self._experts(received, counts_SL, experts)
        returned = _AllToAll.apply(out, send_splits, recv_splits, self.group, self.mirrored)
        out_TKD = PermuteRows.apply(returned, inverse_R, order_R).view(tokens, top_k, -1)
        return (out_TKD * routing.weights_TK.unsqueeze(-1).to(out_TKD.dtype)).sum(dim=1)

    def _received_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """(S, L): the rows each source rank sends to each of this rank's experts. Mirrored: every source routes as
        this rank does, so each sends what this rank sends to itself (exact when routing is balanced)."""
        if self.mirrored:
            own_L = counts_E.view(self.ep_size, self.local_experts)[self.ep_rank]
            counts_SL = own_L.expand(self.ep_size, -1).contiguous()
            self.received_rows.append(int(counts_SL.sum()))
            return counts_SL
        recv_counts = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts, counts_E, group=self.group)   # L counts from each source
        return recv_counts.view(self.ep_size, self.local_experts)

    def _peer_counts(self, counts_SL: torch.Tensor) -> torch.Tensor:
        """(P, S, L): every etp peer's received counts; mirrored, each peer received what this rank did."""
        if self.mirrored:
            return counts_SL.expand(self.etp_size, *counts_SL.shape).contiguous()
        counts_PSL = counts_SL.new_empty((self.etp_size * counts_SL.shape[0], counts_SL.shape[1]))
        dist.all_gather_into_tensor(counts_PSL, counts_SL.contiguous(), group=self.etp_group)
        return counts_PSL.view(self.etp_size, *counts_SL.shape)

    def _experts(self, received: torch.Tensor, counts_SL: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """The local experts on the received rows (ordered by source rank, then expert); same order out."""
        sizes = None
        if self.etp_size > 1:  # every etp peer's rows, each peer applying its slice of the FFN
            counts_PSL = self._peer_counts(counts_SL)
            sizes = counts_PSL.sum((1, 2)).tolist()
            received = _GatherFromPeers.apply(received, sizes, self.etp_rank, self.etp_group)
            counts_SL = counts_PSL.flatten(0, 1)  # (peer, source) pairs act as sources
        index, inverse = _segments_to_expert_major(counts_SL)
        weights = [_local(w) for w in (experts.gate_proj, experts.up_proj, experts.down_proj)]
        if self.compute_dtype is not None:
            weights = [w.to(self.compute_dtype) for w in weights]
        out = swiglu_experts(PermuteRows.apply(received, index, inverse), counts_SL.sum(0), *weights,
                             activation=experts.activation, backend=experts.backend,
                             low_rank=experts.low_rank(local=_local))
        out = PermuteRows.apply(out, inverse, index)
        if sizes is not None:
            out = _SumToOwners.apply(out, sizes, self.etp_rank, self.etp_group)
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def apply_expert_parallel(moe_blocks: list[nn.Module], expert_mesh, *, expert_weights: dict[str, int],
                          compute_dtype: torch.dtype | None) -> None:
    """Keep this rank's E/ep experts of every block, and its 1/etp of their FFN, as DTensors (Replicate over edp,
    Shard(0) over ep, the FFN dimension sharded over etp), and route through all-to-all. On the meta device (the
    engine's path) the slices are materialised and initialised later; with real tensors the full expert tensors must
    hold the same values on every rank beforehand. ``expert_weights``: each grouped weight and the dimension of its FFN
    width (the family's ``ShardingPlan.experts``)."""
    ep_size, ep_rank = expert_mesh["ep"].size(), expert_mesh["ep"].get_local_rank()
    etp_size, etp_rank = expert_mesh["etp"].size(), expert_mesh["etp"].get_local_rank()
    for block in moe_blocks:
        experts: GroupedExperts = block.experts
        total = experts.num_experts
        assert total % ep_size == 0, "train checks the layout first (config/layout.py layout_problems)"
        first, first_dim = next(iter(expert_weights.items()))
        ffn = getattr(experts, first).shape[first_dim]
        assert ffn % etp_size == 0, "train checks the layout first (config/layout.py layout_problems)"
        local, ffn_local = total // ep_size, ffn // etp_size
        ffn_part = slice(etp_rank * ffn_local, (etp_rank + 1) * ffn_local)
        for name, ffn_dim in expert_weights.items():
            full = getattr(experts, name)
            index = [slice(ep_rank * local, (ep_rank + 1) * local), slice(None), slice(None)]
            index[ffn_dim] = ffn_part
            piece = full.detach()[tuple(index)].clone()
            sharded = DTensor.from_local(piece, expert_mesh, [Replicate(), Shard(0), Shard(ffn_dim)], run_check=False)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        experts.num_experts = local
        block.token_dispatcher = ExpertParallelDispatcher(
            group=expert_mesh["ep"].get_group(), ep_size=ep_size, num_experts=total, compute_dtype=compute_dtype,
            etp_group=expert_mesh["etp"].get_group(), etp_size=etp_size, etp_rank=etp_rank)


_FFN_DIM = 2  # of the factor an ExpertAdapter names ffn_factor


def shard_expert_adapters(moe_blocks: list[nn.Module], expert_mesh) -> None:
    """LoRA under expert parallelism: keep the adapters of this rank's E/ep experts, as DTensors placed like their
    experts (Replicate over edp, Shard(0) over ep), whose local shards the experts read. Over etp each adapter is
    split as its weight: gate/up are column-parallel (each etp rank holds F/etp of their output rows), so B is split
    there and A whole; down is row-parallel (F/etp of its input columns), so A is split there and B whole. The whole
    factor's gradient is then partial over etp (each rank's FFN slice contributes to it) and is summed there
    (``all_reduce_expert_grads``), as the partial outputs of the base are. The adapters arrive whole (E, ...) with
    the values one process draws."""
    ep_size, ep_rank = expert_mesh["ep"].size(), expert_mesh["ep"].get_local_rank()
    etp_size, etp_rank = expert_mesh["etp"].size(), expert_mesh["etp"].get_local_rank()
    for block in moe_blocks:
        experts: GroupedExperts = block.experts
        adapters = [m for m in experts.children() if isinstance(m, ExpertAdapter)]
        for adapter in adapters:
            for name, full in list(adapter.named_parameters(recurse=False)):
                local = full.shape[0] // ep_size
                index: list[slice] = [slice(ep_rank * local, (ep_rank + 1) * local)]
                etp_placement = Replicate()
                if name == adapter.ffn_factor:
                    ffn = full.shape[_FFN_DIM]
                    assert ffn % etp_size == 0, "train checks the layout first (config/layout.py layout_problems)"
                    part = ffn // etp_size
                    index += [slice(None)] * (_FFN_DIM - 1) + [slice(etp_rank * part, (etp_rank + 1) * part)]
                    etp_placement = Shard(_FFN_DIM)
                piece = full.detach()[tuple(index)].clone()
                sharded = DTensor.from_local(piece, expert_mesh, [Replicate(), Shard(0), etp_placement],
                                             run_check=False, shape=full.shape, stride=full.stride())
                setattr(adapter, name, nn.Parameter(sharded, requires_grad=full.requires_grad))


def assume_mirrored_routing(model: nn.Module) -> list[ExpertParallelDispatcher]:
    """Make every expert-parallel dispatcher of ``model`` take the row counts other ranks would send as this rank's
    own (every rank of the expert group routes as this one does) instead of exchanging them. For one rank run alone
    under a fake process group, whose all-to-all returns no real counts: the shapes it then gives the token exchange
    are those the real one delivers when routing is balanced (``debug.force_load_balance``), docs/plan.md. Returns
    the dispatchers (each records its received rows per forward)."""
    dispatchers = [m.token_dispatcher for m in model.modules()
                   if isinstance(getattr(m, "token_dispatcher", None), ExpertParallelDispatcher)]
    for dispatcher in dispatchers:
        dispatcher.mirrored = True
    return dispatchers


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """In module order, the same on every rank: collectives issued per parameter must pair up across ranks (a set
    would iterate in id order, which differs between processes)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


def all_reduce_expert_grads(model: nn.Module, expert_mesh) -> None:
    """Sum expert gradients over the expert-data-parallel ranks that hold the same experts, and those of expert
    tensors whole over etp (a LoRA adapter's unsplit factor) over the etp ranks, whose FFN slices each gave a part."""
    if expert_mesh is None:
        return
    edp, etp = expert_mesh["edp"], expert_mesh["etp"]
    etp_dim = expert_mesh.mesh_dim_names.index("etp")
    for param in expert_parameters(model):
        # the step's gradient: bf16 parameters accumulating several microbatches keep it in their fp32 main_grad
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is None:
            continue
        if edp.size() > 1:
            dist.all_reduce(_local(grad), group=edp.get_group())
        if etp.size() > 1 and isinstance(param, DTensor) and param.placements[etp_dim].is_replicate():
            dist.all_reduce(_local(grad), group=etp.get_group())
