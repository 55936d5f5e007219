"""Context parallelism: each of the cp ranks holds a contiguous 1/cp slice of every row (tokens, positions,
activations, loss); attention gathers the keys and values of the whole row and attends from the local queries
with the row's causal and document mask, so no token ever sees past itself or into another document.

Per layer: one all-gather of the keys and values together (its backward one reduce-scatter of their gradients). On
CUDA the local queries run flash (varlen) attention over the documents; elsewhere SDPA with an explicit mask. What
depends only on the microbatch's documents (the varlen offsets, the mask) is built once and reused by every layer and
by the recompute.

Every weight is whole on each cp rank and sees only that rank's tokens: gradients are summed over the cp group.
The slices are contiguous, so the first ranks do less attention work than the last (no load balancing yet).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from openrecipes.models.common.attention import (
    Documents,
    QuerySlice,
    attention_mask,
    sliced_query_attention,
    sliced_query_varlen,
)
from openrecipes.models.families import ShardingPlan
from openrecipes.parallel.collectives import gather_along_dim

# microbatches whose layouts are kept: 1F1B keeps up to pp microbatches in flight, each recomputed in its backward
# (interleaved, each chunk's stage rebuilds its own documents: more entries in flight; a miss only rebuilds)
_CACHED_MICROBATCHES = 8


class ContextParallelAttention:
    """An attention backend: local queries over the whole row's keys and values. ``kernel`` is the recipe's
    attention choice: ``auto`` and ``varlen`` take flash attention on CUDA, ``sdpa`` and ``reference`` the mask."""

    def __init__(self, cp_mesh, kernel: str = "auto") -> None:
        self.group, self.rank, self.size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
        self.kernel = kernel
        self._cache: OrderedDict = OrderedDict()

    def __call__(self, q, k, v, *, scale: float, documents: Documents | None, window: int | None) -> torch.Tensor:
        # keys and values travel together, (2, B, T, K, D) with the sequence outside the heads: the gathered whole
        # is one contiguous block per row. Every rank's queries read all keys: each key's gradient is summed over
        # the group (the gather's backward reduce-scatters).
        kv = gather_along_dim(torch.stack((k.transpose(1, 2), v.transpose(1, 2))), 2, self.group, self.size)
        k_full, v_full = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        rows, tokens, queries = q.shape[0], k_full.shape[2], q.shape[2]
        offset = self.rank * queries
        if documents is None:  # one document per row
            ids = torch.zeros(rows, tokens, dtype=torch.long, device=q.device)
            cu = torch.arange(rows + 1, dtype=torch.int32, device=q.device) * tokens
            documents = Documents(document_ids=ids, cu_seqlens=cu, max_seqlen=tokens)
        if q.is_cuda and self.kernel in ("auto", "varlen"):
            query_slice = self._cached(documents, ("varlen",), lambda: QuerySlice.build(
                documents, tokens=tokens, query_offset=offset, query_tokens=queries))
            return sliced_query_varlen(q, k_full, v_full, scale=scale, query_slice=query_slice, window=window)
        mask = self._cached(documents, ("mask", window), lambda: attention_mask(
            tokens, documents=documents, window=window, device=q.device, query_offset=offset, query_tokens=queries))
        return sliced_query_attention(q, k_full, v_full, scale=scale, query_offset=offset, documents=documents,
                                      window=window, mask=mask)

    def _cached(self, documents: Documents, key: tuple, build):
        """Built once per microbatch: the entry holds the Documents object itself, so identity (not a reusable id)
        decides a hit."""
        entry_key = (id(documents), key)
        entry = self._cache.get(entry_key)
        if entry is not None and entry[0] is documents:
            self._cache.move_to_end(entry_key)
            return entry[1]
        value = build()
        self._cache[entry_key] = (documents, value)
        while len(self._cache) > _CACHED_MICROBATCHES * 2:  # a mask per window kind, or varlen offsets
            self._cache.popitem(last=False)
        return value


def apply_context_parallel(model: nn.Module, plan: ShardingPlan, layers: list[nn.Module], cp_mesh) -> None:
    """Every layer's attention reads the whole row's keys and values through the cp group (the kernel choice the
    model was built with is kept)."""
    backends: dict[str, ContextParallelAttention] = {}
    for layer in layers:
        attention = plan.attention_of(layer)
        kernel = attention.backend if isinstance(attention.backend, str) else "auto"
        attention.backend = backends.setdefault(kernel, ContextParallelAttention(cp_mesh, kernel))
