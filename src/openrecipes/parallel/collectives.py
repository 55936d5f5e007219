"""Differentiable collectives shared by the parallel layouts, and the overlapped gradient sum of replicated weights.

Each collective is one call into the process group on a flat buffer (``all_gather_into_tensor``,
``reduce_scatter_tensor``): no per-rank lists, no all-reduce where every rank keeps only a slice.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn


# newer torch renames the flat-buffer collectives (the old names warn); torch 2.11 has only the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (rank order)."""
    # concatenated along the first dimension (the form every backend takes), then viewed as stacked
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    # (size, ..., n, ...) -> (..., size * n, ...): a view when the dimensions before ``dim`` have size 1
    return out.unflatten(0, (size, x.shape[0])).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """``x`` summed over the group; each rank keeps its 1/size slice along ``dim``."""
    pieces = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous()
    out = pieces.new_empty(pieces.shape[1:])
    _reduce_scatter_single(out, pieces.flatten(0, 1), group=group)
    return out


class _GatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim: int, group, size: int, sum_grads: bool):
        ctx.dim, ctx.group, ctx.size, ctx.sum_grads = dim, group, size, sum_grads
        ctx.rank = dist.get_rank(group) if not sum_grads else 0
        return _gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grads:
            return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.size), None, None, None, None
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


class _ReduceScatterAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim: int, group, size: int):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _reduce_scatter(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.size), None, None, None


def gather_along_dim(x: torch.Tensor, dim: int, group, size: int, *, sum_grads: bool = True) -> torch.Tensor:
    """Every rank's slice along ``dim`` -> the whole tensor on every rank. The backward reduce-scatters the gradient
    (each rank's consumers produced only part of it) or, without ``sum_grads``, keeps this rank's slice of a
    gradient its consumers already summed."""
    return _GatherAlongDim.apply(x, dim, group, size, sum_grads)


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Partial sums on every rank -> their sum, each rank keeping its slice along ``dim``. The backward gathers."""
    return _ReduceScatterAlongDim.apply(x, dim, group, size)


def _sharded_by_fsdp(param: nn.Parameter) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and "dp" in (param.device_mesh.mesh_dim_names or ())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _accumulated_grad(param: nn.Parameter) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _side_group(group):
    """A second communicator over the ranks of ``group``. Gradient sums run on it while the backward's own
    collectives (sequence gathers, reduce-scatters) keep ``group``: on one communicator they would queue behind the
    large gradient all-reduces and stall the next layer. Every rank creates every such group, in the same order."""
    mine = dist.get_process_group_ranks(group)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    side = None
    for ranks in sorted({tuple(r) for r in everyone}):
        created = dist.new_group(list(ranks))
        if list(ranks) == mine:
            side = created
    return side


class ReplicatedGradSum:
    """Sums over ``group`` the gradients of weights whole on each of its ranks (each saw only its own tokens).

    Armed for a backward (the last microbatch of a step), it starts each gradient's all-reduce as soon as the
    backward has accumulated it, so the sums overlap the rest of the backward; ``finish`` sums what was not started
    (everything when not armed, and weights FSDP2 shards, whose gradients appear only after its reduce-scatter) and
    waits. The sums start in one fixed order on every rank (the reverse of the parameter order, roughly the order the
    backward produces them), whatever order the hooks fire in.
    """

    def __init__(self, model: nn.Module, parameters, group) -> None:
        self._model = model
        self._parameters = parameters  # a callable: FSDP2 replaces the parameter objects after this is built
        self.group = group
        self._order: list[nn.Parameter] | None = None
        self._side = None
        self._armed = False
        self._ready: list[bool] = []
        self._next = 0
        self._works: list = []

    def _install(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._side = _side_group(self.group)
        # Under FSDP2 every such weight is sharded over dp, and between a forward and its backward the model may hold
        # FSDP's unsharded stand-ins (the root keeps them): hooks there would sum gradients FSDP reduce-scatters
        # itself. Those sums all wait for ``finish``.
        overlap = not isinstance(self._model, FSDPModule)
        self._order = list(reversed([p for p in self._parameters() if overlap and not _sharded_by_fsdp(p)]))
        for index, param in enumerate(self._order):
            param.register_post_accumulate_grad_hook(functools.partial(self._on_grad, index))

    def arm(self, armed: bool) -> None:
        """Start the sums during the coming backward (``armed``) or leave them all to ``finish``."""
        if self._order is None:
            self._install()
        self._armed, self._next, self._ready = armed, 0, [False] * len(self._order)

    def _on_grad(self, index: int, _param: nn.Parameter) -> None:
        # installed at the first arm, after the fp32 accumulators' hooks on the same weights (GradientSync attaches
        # those first): the gradient read here is the step's whole one
        if not self._armed:
            return
        self._ready[index] = True
        while self._next < len(self._order) and self._ready[self._next]:
            grad = _accumulated_grad(self._order[self._next])
            self._works.append(dist.all_reduce(_local(grad), group=self._side, async_op=True))
            self._next += 1

    def finish(self) -> None:
        if self._order is None:
            self._install()
        started = {id(p) for p in self._order[:self._next]} if self._armed else set()
        for param in self._parameters():
            grad = _accumulated_grad(param)
            if grad is not None and id(param) not in started:
                self._works.append(dist.all_reduce(_local(grad), group=self._side, async_op=True))
        for work in self._works:
            work.wait()  # on CUDA: the compute stream waits, the host does not
        self._works, self._armed, self._next = [], False, 0
