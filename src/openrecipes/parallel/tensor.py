"""Tensor parallelism with sequence parallelism, applied from outside the model.

Between attention blocks the residual stream of a TP rank holds its 1/tp slice of the sequence (sequence
parallel): norms, the MoE block (experts whole on every TP rank, or split by EP over all ranks; each rank routes
its own tokens), the final norm,
the LM head and the loss work on that slice. Attention all-gathers the sequence, runs q/k/v column-parallel
(each rank its heads) and o_proj row-parallel, and reduce-scatters the output back to sequence slices.

Weights split by TP are DTensors (Shard on the tp mesh), so checkpoints reshard between TP sizes. Every other
weight is whole on each TP rank and sees only that rank's tokens: its gradients are summed over the TP group after
the backward (``all_reduce_replicated_grads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from openrecipes.parallel.collectives import GatherAlongDim


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
        plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel(output_layouts=Shard(1))}
        if getattr(attention, "output_gate_proj", None) is not None:
            plan["output_gate_proj"] = ColwiseParallel()
        parallelize_module(attention, tp_mesh, plan)
        original = attention.forward

        def forward(x_local, *args, _original=original, **kwargs):
            # the column-parallel projections reading the gathered sequence already sum their partial input
            # gradients over TP (their Replicate input layout): the gather's backward must not sum again
            x_full = GatherAlongDim.apply(x_local, 1, group, tp_rank, tp_size, False)
            return _original(x_full, *args, **kwargs)

        attention.forward = forward
    embedding = next((m for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    if embedding is not None:  # a later pipeline stage has none: it receives its slice from the previous stage
        embed_forward = embedding.forward
        # Each rank keeps its slice; the embedding's gradient is then partial like every replicated weight's.
        embedding.forward = lambda ids: embed_forward(ids).chunk(tp_size, dim=1)[tp_rank]
    # by name: FSDP later replaces the parameter objects (and Python may hand their old ids to new objects)
    model.tp_sharded_parameter_names = frozenset(n for n, p in model.named_parameters() if isinstance(p, DTensor))


def replicated_parameters(model: nn.Module, *, include_tp_shards: bool = False) -> list[nn.Parameter]:
    """Parameters whole on every rank of the TP (or CP) group, in the same order on every rank (with
    ``include_tp_shards``, TP's shards too: they are the same on every rank of a CP group). FSDP may still shard them
    over dp; expert-parallel experts are left out (their gradients are summed over edp instead)."""
    sharded = frozenset() if include_tp_shards else getattr(model, "tp_sharded_parameter_names", frozenset())
    return [p for n, p in model.named_parameters()
            if p.requires_grad and n not in sharded and not _expert_parallel(p)]


def _expert_parallel(param: nn.Parameter) -> bool:
    return isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())


def all_reduce_replicated_grads(model: nn.Module, mesh, *, include_tp_shards: bool = False) -> None:
    """Weights whole on every rank of ``mesh`` (a TP or CP group) saw only that rank's tokens: sum their gradients
    over the group."""
    group = mesh.get_group()
    for param in replicated_parameters(model, include_tp_shards=include_tp_shards):
        grad = getattr(param, "main_grad", None)
        grad = grad if grad is not None else param.grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def local_sequence_slice(tensor: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This TP rank's slice of a (B, T, ...) tensor along the sequence."""
    return tensor.chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()]
