"""FlexAttention over packed documents: the block mask is derived from the documents' boundaries in
O((T/128)^2) work, never from a T×T mask (``create_block_mask`` evaluates the mask over every pair, which at 128K
tokens is a 128 GiB tensor when not compiled).

A (query block, key block) pair is empty when every key is in an earlier document than every query (or outside the
window, or after the queries), full when every query and key share one document and the window, and partial
otherwise; only partial blocks evaluate the mask per element. Full blocks skip that work, which is where FlexAttention
gains over flash varlen on short packed documents (BENCHMARKS.md, attention paths).

Eager FlexAttention materializes the scores, so on CUDA the kernel is always the compiled one. Its backward does not
run on CPU (torch 2.13): the CPU path serves the forward only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

BLOCK = 128  # FlexAttention's default tile: the mask is classified per BLOCK x BLOCK tile
_compiled_flex = None


def document_index(documents, rows: int, tokens: int, device: torch.device) -> torch.Tensor:
    """(B, T) int32 index of each token's document (``Documents.index``); ``documents`` None: one per row."""
    if documents is None:
        return torch.zeros(rows, tokens, dtype=torch.int32, device=device)
    return documents.index(device)


def document_block_mask(index_BT: torch.Tensor, *, window: int | None) -> BlockMask:
    """The causal (and windowed) document mask of ``index_BT`` (``document_index``) as a FlexAttention BlockMask."""
    rows, tokens = index_BT.shape
    blocks = -(-tokens // BLOCK)
    # padding repeats the row's last document: padded positions are outside the sequence and never read
    padded = F.pad(index_BT, (0, blocks * BLOCK - tokens), mode="replicate") if blocks * BLOCK != tokens else index_BT
    tiles = padded.view(rows, blocks, BLOCK)
    first, last = tiles[..., 0], tiles[..., -1]  # the index increases along a row: a tile's min and max
    q_first, q_last = first[:, :, None], last[:, :, None]
    k_first, k_last = first[:, None, :], last[:, None, :]
    q_block = torch.arange(blocks, device=index_BT.device)[:, None]
    k_block = torch.arange(blocks, device=index_BT.device)[None, :]
    visible = (k_block <= q_block) & (k_last >= q_first)
    full = (k_block < q_block) & (k_first == q_last)
    if window is not None:
        gap = (q_block - k_block) * BLOCK  # query minus key position, between gap - (BLOCK-1) and gap + (BLOCK-1)
        visible = visible & (gap - (BLOCK - 1) < window)
        full = full & (gap + (BLOCK - 1) < window)
    partial = visible & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = (q_idx >= kv_idx) & (index_BT[b, q_idx] == index_BT[b, kv_idx])
        if window is not None:
            allowed = allowed & (q_idx - kv_idx < window)
        return allowed

    def counts_and_indices(chosen: torch.Tensor):
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)  # chosen tiles first, in key order
        return chosen.sum(dim=-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    kv_num, kv_indices = counts_and_indices(partial)
    full_num, full_indices = counts_and_indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_kv_num_blocks=full_num, full_kv_indices=full_indices,
                                    BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(tokens, tokens))


def flex_document_attention(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, *, scale: float,
                            documents, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within documents (and ``window``) through FlexAttention; returns (B, H, T, D). ``sinks``
    (H,): per-head logits in each softmax's denominator, applied to the output through the kernel's logsumexp
    (``rescale_for_sinks``), so no T x T tensor is ever made."""
    rows, heads, tokens, _ = q_BHTD.shape
    block_mask = document_block_mask(document_index(documents, rows, tokens, q_BHTD.device), window=window)
    # inside a compiled block the block's own compile fuses the kernel
    compiled = q_BHTD.is_cuda and not torch.compiler.is_compiling()
    kernel = _cuda_kernel() if compiled else flex_attention
    options = dict(block_mask=block_mask, scale=scale, enable_gqa=heads != k_BKTD.shape[1])
    if sinks is None:
        return kernel(q_BHTD, k_BKTD, v_BKTD, **options)
    out_BHTD, aux = kernel(q_BHTD, k_BKTD, v_BKTD, return_aux=AuxRequest(lse=True), **options)
    return rescale_for_sinks(out_BHTD, aux.lse, sinks)


def rescale_for_sinks(out_BHTD: torch.Tensor, lse_BHT: torch.Tensor, sinks_H: torch.Tensor) -> torch.Tensor:
    """Attention with per-head sinks from attention without them: with Z = exp(lse) the row's softmax denominator,
    adding exp(sink) to it scales every probability, hence the output, by Z / (Z + exp(sink)) = sigmoid(lse - sink).
    Exact, and differentiable through ``lse`` (FlexAttention's logsumexp carries a gradient)."""
    wide = torch.promote_types(out_BHTD.dtype, torch.float32)
    gate_BHT = torch.sigmoid(lse_BHT.to(wide) - sinks_H.to(wide)[None, :, None])
    return (out_BHTD.to(wide) * gate_BHT[..., None]).to(out_BHTD.dtype)


def _cuda_kernel():
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex
