"""Tensor parallelism with sequence parallelism, applied from outside the model.

Between attention blocks the residual stream of a TP rank holds its 1/tp slice of the sequence (sequence
parallel): norms, the MoE block (experts whole on every TP rank, or split by EP over all ranks; each rank routes
its own tokens), the final norm, the LM head and the loss work on that slice. Attention all-gathers the sequence once,
runs q/k/v (and Muse Spark's output gate) column-parallel on it, each rank its heads, and o_proj row-parallel; one
reduce-scatter sums o_proj's partial outputs back to sequence slices. The backward mirrors it: one all-gather of the
output gradient, one reduce-scatter of the input gradient. Three collectives a layer in the forward, none of them
per projection.

Weights split by TP are DTensors (Shard on the tp mesh), so checkpoints reshard between TP sizes, but the matmuls run on
their local shards (``to_local``): DTensor's per-op sharding propagation on the host would cost more than these
matmuls take on the GPU. Every other weight is whole on each TP rank and sees only that rank's tokens: its gradients
are summed over the TP group (``ReplicatedGradSum``), overlapping the backward when the loop arms it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from openrecipes.parallel.collectives import ReplicatedGradSum, gather_along_dim, reduce_scatter_along_dim


def _shard(module: nn.Linear, name: str, tp_mesh, dim: int) -> None:
    param = getattr(module, name)
    sharded = distribute_tensor(param.detach(), tp_mesh, [Shard(dim)])
    setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _column_parallel(module: nn.Linear, tp_mesh) -> None:
    """Output features split: the local matmul gives this rank's heads of the whole sequence."""
    _shard(module, "weight", tp_mesh, 0)
    if module.bias is not None:
        _shard(module, "bias", tp_mesh, 0)
    module.forward = lambda x, _m=module: F.linear(x, _local(_m.weight), _local(_m.bias))


def _row_parallel(module: nn.Linear, tp_mesh) -> None:
    """Input features split: the local matmul gives a partial sum of the whole sequence; one reduce-scatter sums it
    and leaves each rank its sequence slice. A bias stays whole (a replicated weight) and is added after the sum."""
    _shard(module, "weight", tp_mesh, 1)
    group, size = tp_mesh.get_group(), tp_mesh.size()

    def forward(x, _m=module):
        out = reduce_scatter_along_dim(F.linear(x, _local(_m.weight)), 1, group, size)
        return out if _m.bias is None else out + _m.bias

    module.forward = forward


def apply_tensor_parallel(model: nn.Module, layers: list[nn.Module], tp_mesh) -> None:
    group, tp_rank, tp_size = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()
    for layer in layers:
        attention = layer.self_attn
        head_dim = getattr(attention, "head_dim", None)
        if head_dim is None or not hasattr(attention, "q_proj"):
            raise ValueError(f"layout.tp: tensor parallelism needs q/k/v/o projections and head_dim, which "
                             f"{type(attention).__name__} does not have")
        heads, kv_heads = attention.q_proj.out_features // head_dim, attention.k_proj.out_features // head_dim
        if kv_heads % tp_size or heads % tp_size:
            raise ValueError(f"layout.tp={tp_size} must divide the {heads} query and {kv_heads} key/value heads")
        # per-head work (Q/K norms, Muse Spark's output norm and sigmoid output gate) follows the heads' split
        for name in ("q_proj", "k_proj", "v_proj", "output_gate_proj"):
            if getattr(attention, name, None) is not None:
                _column_parallel(getattr(attention, name), tp_mesh)
        _row_parallel(attention.o_proj, tp_mesh)
        original = attention.forward

        def forward(x_local, *args, _original=original, **kwargs):
            # one gather feeds every column-parallel projection; its backward reduce-scatters their summed partial
            # input gradients
            return _original(gather_along_dim(x_local, 1, group, tp_size), *args, **kwargs)

        attention.forward = forward
    embedding = next((m for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    if embedding is not None:  # a later pipeline stage has none: it receives its slice from the previous stage
        embed_forward = embedding.forward
        # Each rank embeds its slice; the embedding's gradient is then partial like every replicated weight's.
        embedding.forward = lambda ids: embed_forward(ids.chunk(tp_size, dim=1)[tp_rank])
    # by name: FSDP later replaces the parameter objects (and Python may hand their old ids to new objects)
    model.tp_sharded_parameter_names = frozenset(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    attach_replicated_grad_sum(model, "tp", tp_mesh, include_tp_shards=False)


def attach_replicated_grad_sum(model: nn.Module, name: str, mesh, *, include_tp_shards: bool) -> None:
    """Give ``model`` the gradient sum of its weights replicated over ``mesh`` (``name``: "tp" or "cp")."""
    sums = model.__dict__.setdefault("replicated_grad_sums", {})
    sums[name] = ReplicatedGradSum(model, lambda: replicated_parameters(model, include_tp_shards=include_tp_shards),
                                   mesh.get_group())


def replicated_parameters(model: nn.Module, *, include_tp_shards: bool = False) -> list[nn.Parameter]:
    """Parameters whole on every rank of the TP (or CP) group, in the same order on every rank (with
    ``include_tp_shards``, TP's shards too: they are the same on every rank of a CP group). FSDP may still shard them
    over dp; expert-parallel experts are left out (their gradients are summed over edp instead)."""
    sharded = frozenset() if include_tp_shards else getattr(model, "tp_sharded_parameter_names", frozenset())
    return [p for n, p in model.named_parameters()
            if p.requires_grad and n not in sharded and not _expert_parallel(p)]


def _expert_parallel(param: nn.Parameter) -> bool:
    return isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())


def arm_replicated_grad_sums(model: nn.Module, armed: bool) -> None:
    """Before a backward: start the replicated gradients' sums during it (``armed``: the step's last microbatch) or
    leave them to ``all_reduce_replicated_grads``. With both TP and CP a weight is summed over two groups, one after
    the other: those sums are left to the end."""
    sums = model.__dict__.get("replicated_grad_sums", {})
    if len(sums) == 1:
        next(iter(sums.values())).arm(armed)


def all_reduce_replicated_grads(model: nn.Module, mesh, *, include_tp_shards: bool = False) -> None:
    """Weights whole on every rank of ``mesh`` (a TP or CP group) saw only that rank's tokens: sum their gradients
    over the group (finishing the sums started during the backward)."""
    sums = model.__dict__.setdefault("replicated_grad_sums", {})
    name = "cp" if include_tp_shards else "tp"
    if name not in sums:
        attach_replicated_grad_sum(model, name, mesh, include_tp_shards=include_tp_shards)
    sums[name].finish()


def local_sequence_slice(tensor: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This TP rank's slice of a (B, T, ...) tensor along the sequence."""
    return tensor.chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()]
