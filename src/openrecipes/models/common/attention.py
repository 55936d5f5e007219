"""Causal attention over packed documents, with an optional sliding window.

Tensor legend: B batch rows, T tokens per row, H query heads, K key/value heads, D head dim.

Backends:
- ``reference``: dense fp32 scores with an explicit mask; slow, obviously right; the oracle for tests.
- ``sdpa``: ``F.scaled_dot_product_attention``; pure causal rows use ``is_causal`` (cuDNN/flash on GPU),
  packed rows or windows pass a boolean mask.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention over cu_seqlens) on CUDA, for packed
  documents and windows without a T×T mask.
``auto`` picks varlen on CUDA for packed rows or windows, else sdpa.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("auto", "reference", "sdpa", "varlen")
_CUDA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.MATH]


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
        # A new document starts at each row start and wherever the id changes inside a row.
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        start_offsets = starts.flatten().nonzero().flatten()
        cu_seqlens = torch.cat([start_offsets, start_offsets.new_tensor([rows * tokens])]).to(torch.int32)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
        return cls(document_ids=document_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

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
                           query_offset: int, documents: Documents | None, window: int | None) -> torch.Tensor:
    """Attention of a slice of the queries (starting at ``query_offset``) over the whole row's keys and values."""
    groups = q_BHQD.shape[1] // k_BKTD.shape[1]
    mask = attention_mask(k_BKTD.shape[2], documents=documents, window=window, device=q_BHQD.device,
                          query_offset=query_offset, query_tokens=q_BHQD.shape[2])
    return F.scaled_dot_product_attention(q_BHQD, _expand_kv(k_BKTD, groups), _expand_kv(v_BKTD, groups),
                                          attn_mask=mask, scale=scale)


def attention(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, *, scale: float,
              documents: Documents | None = None, window: int | None = None,
              backend: str = "auto") -> torch.Tensor:
    """Causal attention within documents (and within ``window`` tokens when given). Returns (B, H, T, D).

    ``backend`` may also be a callable taking the same arguments (parallelism plugs in its own this way)."""
    if callable(backend):
        return backend(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window)
    rows, tokens = q_BHTD.shape[0], q_BHTD.shape[2]
    if (documents is not None and documents.max_seqlen == tokens
            and documents.cu_seqlens.numel() - 1 == rows):
        documents = None  # one whole document per row: plain causal attention (the fastest kernels)
    if backend == "auto":
        packed_or_windowed = documents is not None or window is not None
        backend = "varlen" if q_BHTD.is_cuda and packed_or_windowed and _varlen_available() else "sdpa"
    if backend == "reference":
        return _reference(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window)
    if backend == "sdpa":
        return _sdpa(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window)
    if backend == "varlen":
        return _varlen(q_BHTD, k_BKTD, v_BKTD, scale=scale, documents=documents, window=window)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


def _expand_kv(x_BKTD: torch.Tensor, groups: int) -> torch.Tensor:
    return x_BKTD if groups == 1 else x_BKTD.repeat_interleave(groups, dim=1)


def _reference(q, k, v, *, scale, documents, window):
    groups = q.shape[1] // k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    k, v = _expand_kv(k, groups).to(wide), _expand_kv(v, groups).to(wide)
    scores = torch.matmul(q.to(wide), k.transpose(-1, -2)) * scale
    mask = attention_mask(q.shape[2], documents=documents, window=window, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).to(q.dtype)


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
