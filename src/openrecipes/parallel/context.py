"""Context parallelism: each of the cp ranks holds a contiguous 1/cp slice of every row (tokens, positions,
activations, loss); attention gathers the keys and values of the whole row and attends from the local queries
with the row's causal and document mask, so no token ever sees past itself or into another document.

Every weight is whole on each cp rank and sees only that rank's tokens: gradients are summed over the cp group.
The slices are contiguous, so the first ranks do less attention work than the last (no load balancing yet).
"""

from __future__ import annotations

import torch
from torch import nn

from openrecipes.models.common.attention import Documents, sliced_query_attention
from openrecipes.models.families import ShardingPlan
from openrecipes.parallel.collectives import GatherAlongDim


class ContextParallelAttention:
    """An attention backend: local queries over the whole row's keys and values."""

    def __init__(self, cp_mesh) -> None:
        self.group, self.rank, self.size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()

    def __call__(self, q, k, v, *, scale: float, documents: Documents | None, window: int | None) -> torch.Tensor:
        # every rank's queries read all keys: the gradient of each key is summed over the group
        k_full = GatherAlongDim.apply(k, 2, self.group, self.rank, self.size, True)
        v_full = GatherAlongDim.apply(v, 2, self.group, self.rank, self.size, True)
        return sliced_query_attention(q, k_full, v_full, scale=scale, query_offset=self.rank * q.shape[2],
                                      documents=documents, window=window)


def apply_context_parallel(model: nn.Module, plan: ShardingPlan, layers: list[nn.Module], cp_mesh) -> None:
    backend = ContextParallelAttention(cp_mesh)
    for layer in layers:
        plan.attention_of(layer).backend = backend
