"""Causal attention over packed documents, with an optional sliding window.

Tensor legend: B batch rows, T tokens per row, H query heads, K key/value heads, D head dim.

Backends:
- ``reference``: dense fp32 scores with an explicit mask; slow, obviously right; the oracle for tests.
- ``sdpa``: ``F.scaled_dot_product_attention``; pure causal rows use ``is_causal`` (cuDNN/flash on GPU),
  packed rows or windows pass a boolean mask.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention over cu_seqlens) on CUDA, for packed
  documents and windows without a T×T mask.
- ``flex``: FlexAttention with a block mask from the documents' boundaries (``document_flex``), compiled on CUDA.
``auto`` picks varlen on CUDA for packed rows or windows, else sdpa.

Attention sinks (gpt-oss): ``sinks`` (H,) holds one learned logit per query head that joins every row's softmax
denominator and attends to nothing: p(s) = exp(score_s) / (exp(sink) + sum_s' exp(score_s')). ``reference`` computes
it with the sink as an extra softmax column; ``sdpa`` as a virtual key of zeros (score 0) and value zero, whose float
mask entry is the sink, which is exact but makes a (B, H, T, T+1) mask that the kernel keeps for the backward;
``flex`` scales its output by sigmoid(logsumexp - sink), exact with no T x T tensor (``document_flex``). ``varlen``
refuses it (its kernel returns no differentiable logsumexp).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("auto", "reference", "sdpa", "varlen", "flex")
_CUDA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.MATH]


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: where a document starts, at each row's start and wherever the id changes inside a row (rows
    may reuse ids: two documents are the same only where their tokens are adjacent)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


@dataclass(frozen=True, kw_only=True)
class Documents:
    """Where packed documents start and end inside a batch of rows.

    ``document_ids`` (B, T): equal ids are one document; ``cu_seqlens`` (N+1,) int32 offsets of the N documents
    in the flattened B·T token stream; ``max_seqlen`` the longest document (a Python int, so no GPU sync later).
    """

    document_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def from_document_ids(cls, document_ids: torch.Tensor) -> "Documents":
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids must have shape (rows, tokens), got {tuple(document_ids.shape)}")
        rows, tokens = document_ids.shape
        start_offsets = document_starts(document_ids).flatten().nonzero().flatten()
        cu_seqlens = torch.cat([start_offsets, start_offsets.new_tensor([rows * tokens])]).to(torch.int32)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
        return cls(document_ids=document_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

    def index(self, device: torch.device | None = None) -> torch.Tensor:
        """(B, T) int32 index of each token's document, increasing along a row, on ``device``: unlike the ids, two
        documents never share an index, so equality is exactly "same document"."""
        ids = self.document_ids if device is None else self.document_ids.to(device)
        return document_starts(ids).cumsum(dim=1, dtype=torch.int32)

    def whole_rows(self, rows: int, tokens: int) -> bool:
        """Whether each of the ``rows`` rows of ``tokens`` tokens is one whole document."""
        return self.max_seqlen == tokens and self.cu_seqlens.numel() - 1 == rows

    def to(self, device: torch.device | str) -> "Documents":
        return Documents(document_ids=self.document_ids.to(device), cu_seqlens=self.cu_seqlens.to(device),
                         max_seqlen=self.max_seqlen)


def attention_mask(tokens: int, *, documents: Documents | None, window: int | None,
                   device: torch.device, query_offset: int = 0, query_tokens: int | None = None) -> torch.Tensor:
    """Boolean mask (B or 1, 1, Tq, T): True where query t may attend key s. The queries may be a slice of the
    row starting at ``query_offset`` (context parallelism); keys are always the whole row."""
    query_tokens = tokens if query_tokens is None else query_tokens
    query = torch.arange(query_tokens, device=device) + query_offset
    key = torch.arange(tokens, device=device)
    allowed = query[:, None] >= key[None, :]
    if window is not None:
        allowed = allowed & (query[:, None] - key[None, :] < window)
    allowed = allowed[None, None]
    if documents is not None:
        ids = documents.document_ids
        query_ids = ids[:, query_offset:query_offset + query_tokens]
        allowed = allowed & (query_ids[:, None, :, None] == ids[:, None, None, :])
    return allowed


def sliced_query_attention(q_BHQD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, *, scale: float,
                           query_offset: int, documents: Documents | None, window: int | None,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a slice of the queries (starting at ``query_offset``) over the whole row's keys and values.
    ``mask``: the ``attention_mask`` of this slice, when the caller keeps it from layer to layer."""
    groups = q_BHQD.shape[1] // k_BKTD.shape[1]
    if mask is None:
        mask = attention_mask(k_BKTD.shape[2], documents=documents, window=window, device=q_BHQD.device,
                              query_offset=query_offset, query_tokens=q_BHQD.shape[2])
    return F.scaled_dot_product_attention(q_BHQD, _expand_kv(k_BKTD, groups), _expand_kv(v_BKTD, groups),
                                          attn_mask=mask, scale=scale)


@dataclass(frozen=True, kw_only=True)
class QuerySlice:
    """Packed documents seen from a slice of every row's queries, ``[query_offset, key_tokens)``, over the keys
    ``[0, key_tokens)`` of the row, as varlen attention takes them: document i's queries are rows
    ``cu_q[i]:cu_q[i+1]`` of the (B·Q) flattened query slices, its keys rows ``cu_k[i]:cu_k[i+1]`` of the (B·key_tokens)
    flattened key prefixes. A document's queries end where its keys end, so causal attention aligned to the bottom
    right (flash attention's rule when a sequence has fewer queries than keys) is exactly the row's causal mask. A
    document wholly before the slice has keys and no queries; one wholly after has neither."""

    cu_q: torch.Tensor  # (N+1,) int32
    cu_k: torch.Tensor  # (N+1,) int32
    max_q: int  # upper bounds (host ints, no GPU sync): the documents' longest, capped by the slice
    max_k: int
    key_tokens: int

    @classmethod
    def build(cls, documents: Documents, *, tokens: int, query_offset: int, query_tokens: int) -> "QuerySlice":
        cu = documents.cu_seqlens.long()
        rows = documents.document_ids.shape[0]
        starts = cu[:-1]
        row = torch.div(starts, tokens, rounding_mode="floor")  # documents never cross rows
        local = starts - row * tokens
        end = query_offset + query_tokens
        q_starts = row * query_tokens + local.clamp(query_offset, end) - query_offset
        k_starts = row * end + local.clamp(max=end)
        cu_q = torch.cat([q_starts, q_starts.new_tensor([rows * query_tokens])]).to(torch.int32)
        cu_k = torch.cat([k_starts, k_starts.new_tensor([rows * end])]).to(torch.int32)
        return cls(cu_q=cu_q, cu_k=cu_k, max_q=min(documents.max_seqlen, query_tokens),
                   max_k=min(documents.max_seqlen, end), key_tokens=end)


def sliced_query_varlen(q_BHQD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, *, scale: float,
                        query_slice: QuerySlice, window: int | None) -> torch.Tensor:
    """``sliced_query_attention`` with flash attention over the documents (CUDA): no mask, no work across documents
    or past the slice's last query."""
    from torch.nn.attention.varlen import varlen_attn

    rows, heads, queries, head_dim = q_BHQD.shape
    keys = query_slice.key_tokens
    groups = heads // k_BKTD.shape[1]
    k_BKTD, v_BKTD = k_BKTD[:, :, :keys], v_BKTD[:, :, :keys]
    kwargs = {}
    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        kwargs["enable_gqa"] = groups > 1
    else:
        k_BKTD, v_BKTD = _expand_kv(k_BKTD, groups), _expand_kv(v_BKTD, groups)
    to_thd = lambda x: x.transpose(1, 2).reshape(-1, x.shape[1], head_dim)  # noqa: E731
    window_size = (-1, 0) if window is None else (window - 1, 0)
    out_THD = varlen_attn(to_thd(q_BHQD), to_thd(k_BKTD), to_thd(v_BKTD), query_slice.cu_q, query_slice.cu_k,
                          query_slice.max_q, query_slice.max_k, scale=scale, window_size=window_size, **kwargs)
    return out_THD.reshape(rows, queries, heads, head_dim).transpose(1, 2)


def attention(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, *, scale: float,
              documents: Documents | None = None, window: int | None = None,
              backend: str = "auto", sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within documents (and within ``window`` tokens when given). Returns (B, H, T, D).
    ``sinks`` (H,): per-head logits added to each softmax's denominator (see the module docstring).

    ``backend`` may also be a callable taking the same arguments (parallelism plugs in its own this way)."""
    if sinks is not None and sinks.shape != (q_BHTD.shape[1],):
        raise ValueError(f"attention sinks: expected one per query head ({q_BHTD.shape[1]}), got shape "
                         f"{tuple(sinks.shape)} (tensor parallelism does not split sinks)")
    if callable(backend):
        if sinks is not None:  # a parallel backend (context parallelism) has no sink term
            raise ValueError("attention sinks are not supported with a parallel attention backend "
                             "(context parallelism)")
        return backend(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window)
    rows, tokens = q_BHTD.shape[0], q_BHTD.shape[2]
    # one whole document per row: plain causal attention (the fastest kernels). Not decided inside a compiled block,
    # whose every other row layout would then be a recompile: the caller decides there (train/engine.py)
    if documents is not None and not torch.compiler.is_compiling() and documents.whole_rows(rows, tokens):
        documents = None
    if backend == "auto":
        packed_or_windowed = documents is not None or window is not None
        backend = ("varlen" if q_BHTD.is_cuda and packed_or_windowed and _varlen_available() and sinks is None
                   else "sdpa")
    if backend == "reference":
        return _reference(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window, sinks=sinks)
    if sinks is not None:
        if backend == "sdpa":
            return _sdpa_with_sinks(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window,
                                    sinks=sinks)
        if backend == "flex":
            from .document_flex import flex_document_attention

            return flex_document_attention(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window,
                                           sinks=sinks)
        if backend in BACKENDS:
            raise ValueError(f"attention backend {backend!r} does not support attention sinks; use 'sdpa', "
                             "'flex' or 'reference'")
    if backend == "sdpa":
        return _sdpa(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window)
    if backend == "varlen":
        return _varlen(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window)
    if backend == "flex":
        from .document_flex import flex_document_attention

        return flex_document_attention(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


def _expand_kv(x_BKTD: torch.Tensor, groups: int) -> torch.Tensor:
    return x_BKTD if groups == 1 else x_BKTD.repeat_interleave(groups, dim=1)


def _reference(q, k, v, *, scale, documents, window, sinks=None):
    groups = q.shape[1] // k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    k, v = _expand_kv(k, groups).to(wide), _expand_kv(v, groups).to(wide)
    scores = torch.matmul(q.to(wide), k.transpose(-1, -2)) * scale
    mask = attention_mask(q.shape[2], documents=documents, window=window, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v).to(q.dtype)
    # the sink as one more softmax column, dropped after normalising: it takes probability and gives no value
    sink_column = sinks.to(wide)[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v).to(q.dtype)


def _sdpa_with_sinks(q, k, v, *, scale, documents, window, sinks):
    """SDPA over the keys plus one virtual key of zeros (score exactly 0) with a zero value, whose additive float
    mask entry is the head's sink: the softmax then has exp(sink) in its denominator and nothing more."""
    groups = q.shape[1] // k.shape[1]
    rows, heads, tokens, head_dim = q.shape
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    zeros = k.new_zeros(rows, heads, 1, head_dim)
    k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
    allowed = attention_mask(tokens, documents=documents, window=window, device=q.device)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    bias = bias.expand(allowed.shape[0], heads, tokens, tokens)
    sink_column = sinks.to(q.dtype)[None, :, None, None].expand(bias.shape[0], heads, tokens, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat([bias, sink_column], dim=-1), scale=scale)


def _sdpa(q, k, v, *, scale, documents, window):
    groups = q.shape[1] // k.shape[1]
    if documents is None and window is None:
        if q.is_cuda:
            # cuDNN attention is ~1.8x the flash backend for long causal rows on Hopper (peers/ATTENTION.md)
            with sdpa_kernel(_CUDA_PRIORITY, set_priority=True):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
    mask = attention_mask(q.shape[2], documents=documents, window=window, device=q.device)
    # Masked SDPA kernels do not all take GQA; expanding K/V keeps every backend available.
    return F.scaled_dot_product_attention(q, _expand_kv(k, groups), _expand_kv(v, groups), attn_mask=mask,
                                          scale=scale)


def _varlen_available() -> bool:
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


def _varlen(q, k, v, *, scale, documents, window):
    from torch.nn.attention.varlen import varlen_attn

    rows, heads, tokens, head_dim = q.shape
    if documents is None:
        documents = Documents.from_document_ids(
            torch.arange(rows, device=q.device)[:, None].expand(rows, tokens))
    groups = heads // k.shape[1]
    kwargs = {}
    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        kwargs["enable_gqa"] = groups > 1
    else:
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    to_thd = lambda x: x.transpose(1, 2).reshape(rows * tokens, x.shape[1], head_dim)  # noqa: E731
    cu = documents.cu_seqlens.to(q.device)
    window_size = (-1, 0) if window is None else (window - 1, 0)
    out_THD = varlen_attn(to_thd(q), to_thd(k), to_thd(v), cu, cu, documents.max_seqlen, documents.max_seqlen,
                          scale=scale, window_size=window_size, **kwargs)
    return out_THD.reshape(rows, tokens, heads, head_dim).transpose(1, 2)
