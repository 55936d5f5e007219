"""Tensor parallelism with sequence parallelism, applied from outside the model.

Between attention blocks the residual stream of a TP rank holds its 1/tp slice of the sequence (sequence
parallel): norms, the MoE block (experts whole on every TP rank, or split by EP over all ranks; each rank routes
its own tokens), the final norm,
the LM head and the loss work on that slice. Attention all-gathers the sequence, runs q/k/v column-parallel
(each rank its heads) and o_proj row-parallel, and reduce-scatters the output back to sequence slices.

Weights split by TP are DTensors (Shard on the tp mesh), so checkpoints reshard between TP sizes. Every other
weight is whole on each TP rank and sees only that rank's tokens: its gradients are summed over the TP group after
the backward (``GradientSync.synchronize``). The family's ``ShardingPlan`` says which projections split how.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from openrecipes.models.families import ShardingPlan
from openrecipes.parallel.collectives import GatherAlongDim


_STYLES = {"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1))}


def apply_tensor_parallel(model: nn.Module, plan: ShardingPlan, layers: list[nn.Module], tp_mesh) -> None:
    """Split each layer's attention projections as the family's plan says; the attention input is gathered over
    the sequence by a forward pre-hook, the embedding output cut to this rank's slice by a forward hook."""
    group, tp_rank, tp_size = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()

    def gather_sequence(_module, args):
        # the column-parallel projections reading the gathered sequence already sum their partial input
        # gradients over TP (their Replicate input layout): the gather's backward must not sum again
        return (GatherAlongDim.apply(args[0], 1, group, tp_rank, tp_size, False), *args[1:])

    for layer in layers:
        attention = plan.attention_of(layer)
        projections = {name: getattr(attention, name, None) for name in plan.attention_tp}
        present = {name: style for name, style in plan.attention_tp.items() if projections[name] is not None}
        heads = projections["q_proj"].out_features // attention.head_dim
        kv_heads = projections["k_proj"].out_features // attention.head_dim
        if kv_heads % tp_size or heads % tp_size:
            raise ValueError(f"layout.tp={tp_size} must divide the {heads} query and {kv_heads} key/value heads")
        parallelize_module(attention, tp_mesh, {name: _STYLES[style]() for name, style in present.items()})
        attention.register_forward_pre_hook(gather_sequence)
    embedding = plan.part(model, plan.embedding)  # None on a later pipeline stage: it receives its slice
    if embedding is not None:
        # each rank keeps its slice; the embedding's gradient is then partial like every replicated weight's
        embedding.register_forward_hook(lambda _module, _args, out: out.chunk(tp_size, dim=1)[tp_rank])
    unplanned = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)
                 and ".experts." not in name and not any(part in name for part in plan.replicated)]
    if unplanned:
        raise ValueError(f"layout.tp: the sharding plan neither splits nor replicates {unplanned[:3]}")


def local_sequence_slice(tensor: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This TP rank's slice of a (B, T, ...) tensor along the sequence."""
    return tensor.chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()]
