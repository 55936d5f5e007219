"""Tensor parallelism with sequence parallelism, applied from outside the model as the family's sharding plan says.

Between attention blocks the residual stream of a TP rank holds its 1/tp slice of the sequence (sequence
parallel): norms, the MoE block (experts whole on every TP rank, or split by EP over all ranks; each rank routes
its own tokens), the final norm, the LM head and the loss work on that slice. Attention all-gathers the sequence once
(a forward pre-hook), runs the ``colwise`` projections on it, each rank its heads, and the ``rowwise`` one (o_proj)
on its heads; one reduce-scatter sums o_proj's partial outputs back to sequence slices. The backward mirrors it: one
all-gather of the output gradient, one reduce-scatter of the input gradient. Three collectives a layer in the
forward, none of them per projection.

Weights split by TP are DTensors (Shard on the tp mesh), so checkpoints reshard between TP sizes, but the matmuls run on
their local shards: DTensor's per-op sharding propagation on the host would cost more than these matmuls take on the
GPU. The split projections become ``ColumnParallelLinear`` / ``RowParallelLinear`` modules holding the same parameter
names. Every other weight is whole on each TP rank and sees only that rank's tokens: its gradients are summed over the
TP group (``ReplicatedGradSum``, owned by the model's ``GradientSync``).

A LoRA adapter of a split projection (models/common/lora.py) is split so that each rank computes its part of what one
process computes: a column-parallel projection's B is split by rows like its weight (this rank's heads) and A is whole
(its gradient, partial over the heads, is summed over TP as a replicated weight's); a row-parallel projection's A is
split by columns like its weight, its partial rank-r product is reduce-scattered over the sequence (a second, r-wide
collective), and B is whole (its gradient, from this rank's tokens, is summed over TP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from openrecipes.models.families import ShardingPlan
from openrecipes.parallel.collectives import gather_along_dim, reduce_scatter_along_dim


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _sharded(param: nn.Parameter | None, tp_mesh, dim: int) -> nn.Parameter | None:
    if param is None:
        return None
    # every rank holds the same whole weight (built from one seed or read from one checkpoint): each cuts its slice
    # locally (src_data_rank=None) rather than receiving it from rank 0, which also keeps a rank run alone under a
    # fake process group on real values (train/rank_measure.py)
    return nn.Parameter(distribute_tensor(param.detach(), tp_mesh, [Shard(dim)], src_data_rank=None),
                        requires_grad=param.requires_grad)


def _carry_adapter(target: nn.Module, linear: nn.Linear, tp_mesh, *, a_dim: int | None, b_dim: int | None) -> bool:
    """Move ``linear``'s LoRA adapter (if any) onto ``target``, A and B split on the dims given (None: whole)."""
    if not hasattr(linear, "lora_A"):
        return False
    for factor, dim in (("lora_A", a_dim), ("lora_B", b_dim)):
        module = getattr(linear, factor)
        if dim is not None:
            module.weight = _sharded(module.weight, tp_mesh, dim)
        setattr(target, factor, module)  # keeps the names ...q_proj.lora_A.weight
    target.lora_dropout, target.lora_scaling = linear.lora_dropout, linear.lora_scaling
    return True


class ColumnParallelLinear(nn.Module):
    """Output features split over TP: the local matmul gives this rank's heads of the whole sequence."""

    def __init__(self, linear: nn.Linear, tp_mesh) -> None:
        super().__init__()
        self.weight = _sharded(linear.weight, tp_mesh, 0)
        self.bias = _sharded(linear.bias, tp_mesh, 0)
        self.adapted = _carry_adapter(self, linear, tp_mesh, a_dim=None, b_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, _local(self.weight), _local(self.bias))
        if self.adapted:  # in the input's dtype, as models/common/lora.py's hook (fp32 adapters on a bf16 base)
            low_rank = F.linear(self.lora_dropout(x), self.lora_A.weight.to(x.dtype))
            out = out + F.linear(low_rank, _local(self.lora_B.weight).to(x.dtype)) * self.lora_scaling
        return out


class RowParallelLinear(nn.Module):
    """Input features split over TP: the local matmul gives a partial sum of the whole sequence; one reduce-scatter
    sums it and leaves each rank its sequence slice. A bias stays whole (a replicated weight), added after the sum."""

    def __init__(self, linear: nn.Linear, tp_mesh) -> None:
        super().__init__()
        self.weight = _sharded(linear.weight, tp_mesh, 1)
        self.bias = linear.bias
        self.group, self.size = tp_mesh.get_group(), tp_mesh.size()
        self.adapted = _carry_adapter(self, linear, tp_mesh, a_dim=1, b_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_scatter_along_dim(F.linear(x, _local(self.weight)), 1, self.group, self.size)
        if self.adapted:
            low_rank = F.linear(self.lora_dropout(x), _local(self.lora_A.weight).to(x.dtype))
            low_rank = reduce_scatter_along_dim(low_rank, 1, self.group, self.size)
            out = out + F.linear(low_rank, self.lora_B.weight.to(x.dtype)) * self.lora_scaling
        return out if self.bias is None else out + self.bias


_STYLES = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}


def apply_tensor_parallel(model: nn.Module, plan: ShardingPlan, layers: list[nn.Module], tp_mesh) -> None:
    """Split each layer's attention projections as the family's plan says; the attention input is gathered over the
    sequence by a forward pre-hook, and the embedding looks up only this rank's slice of the tokens."""
    group, tp_rank, tp_size = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()

    def gather_sequence(_module, args):
        # one gather feeds every column-parallel projection; its backward reduce-scatters their summed partial
        # input gradients
        return (gather_along_dim(args[0], 1, group, tp_size), *args[1:])

    for layer in layers:
        attention = plan.attention_of(layer)
        present = {name: style for name, style in plan.attention_tp.items() if getattr(attention, name) is not None}
        # the attention module says its head counts (ShardingPlan): its projections need not be q/k/v ones
        assert not (attention.num_kv_heads % tp_size or attention.num_heads % tp_size), (
            "train checks the layout first (config/layout.py layout_problems)")
        # per-head work (Q/K norms, Muse Spark's output norm and sigmoid output gate) follows the heads' split
        for name, style in present.items():
            setattr(attention, name, _STYLES[style](getattr(attention, name), tp_mesh))
        attention.register_forward_pre_hook(gather_sequence)
    embedding = plan.part(model, plan.embedding)  # None on a later pipeline stage: it receives its slice
    if embedding is not None:
        # each rank embeds its slice; the embedding's gradient is then partial like every replicated weight's
        embedding.register_forward_pre_hook(lambda _module, args: (args[0].chunk(tp_size, dim=1)[tp_rank],))
    # the whole factor of a split projection's LoRA adapter is replicated like the weights the plan names
    unplanned = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)
                 and ".experts." not in name and ".lora_" not in name
                 and not any(part in name for part in plan.replicated)]
    if unplanned:
        raise ValueError(f"layout.tp: the sharding plan neither splits nor replicates {unplanned[:3]}")


def local_sequence_slice(tensor: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This TP rank's slice of a (B, T, ...) tensor along the sequence."""
    return tensor.chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()]
