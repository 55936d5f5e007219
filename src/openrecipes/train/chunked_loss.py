"""The LM head and the per-token loss in one, over chunks of tokens: the (tokens x vocabulary) logits never exist
at once (``kernels.loss_chunk_tokens``).

The forward computes each chunk's logits, keeps only their log-sum-exp (one float a token), and drops them; the
backward computes each chunk's logits again and turns them into the chunk's hidden-state gradient and its share of
the head's weight gradient. Memory is O(chunk x vocabulary) instead of O(tokens x vocabulary), for one more head
matmul. Each chunk runs the same operations as the unchunked path (``train.engine.token_loss_sum`` on the head's
output): the head in its dtype, an optional soft cap evaluated in fp32 and returned in the head's dtype, then the
cross entropy in fp32.

``ChunkedLossHead`` takes the place of the model's LM head (same parameter, same name), so the loss is computed
inside the model's forward: data parallelism gathers the head's weight for that forward as it does for the head.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def _chunk_logits(h_ND: torch.Tensor, weight_VD: torch.Tensor, softcap: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits of one chunk exactly as the unchunked path makes them, and tanh(logits / cap) when capped
    (its backward needs it)."""
    logits = F.linear(h_ND, weight_VD)
    if softcap is None:
        return logits.float(), None
    tanh = torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / softcap)
    return (softcap * tanh).to(logits.dtype).float(), tanh


class LinearCrossEntropy(torch.autograd.Function):
    """Σ weight · cross entropy(h @ Wᵀ, target), computed ``chunk`` tokens at a time in both passes."""

    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, weights_N: torch.Tensor,
                chunk: int, softcap: float | None) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        lse_N = torch.empty(h_ND.shape[0], dtype=torch.float32, device=h_ND.device)
        for start in range(0, h_ND.shape[0], chunk):
            end = min(start + chunk, h_ND.shape[0])
            logits, _ = _chunk_logits(h_ND[start:end], weight_VD, softcap)
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets_N[start:end, None]).squeeze(1)
            total += ((lse - target_logit) * weights_N[start:end].float()).sum()
            lse_N[start:end] = lse
        ctx.save_for_backward(h_ND, weight_VD, targets_N, weights_N, lse_N)
        ctx.chunk, ctx.softcap = chunk, softcap
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        h_ND, weight_VD, targets_N, weights_N, lse_N = ctx.saved_tensors
        grad_h = torch.empty_like(h_ND) if ctx.needs_input_grad[0] else None
        # the weight gradient sums over chunks: accumulate in fp32, round to the weight's dtype once
        grad_w = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, h_ND.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, h_ND.shape[0])
            h = h_ND[start:end]
            logits, tanh = _chunk_logits(h, weight_VD, ctx.softcap)
            scale = weights_N[start:end].float() * grad_total
            # d/dlogits of weight · (lse - logit[target]) = weight · (softmax - onehot(target))
            grad_logits = torch.exp(logits - lse_N[start:end, None]) * scale[:, None]
            grad_logits.scatter_add_(1, targets_N[start:end, None], -scale[:, None])
            if tanh is not None:  # d(cap · tanh(x / cap))/dx = 1 - tanh²
                grad_logits = grad_logits * (1 - tanh * tanh)
            grad_logits = grad_logits.to(h.dtype)
            if grad_h is not None:
                grad_h[start:end] = grad_logits @ weight_VD
            if grad_w is not None:
                grad_w += (grad_logits.t() @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype), None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, *,
                         chunk: int, softcap: float | None = None) -> torch.Tensor:
    """Σ weight · cross entropy of the logits ``h @ weightᵀ`` (soft-capped when ``softcap``) against ``targets``,
    in fp32, never holding more than ``chunk`` tokens' logits. ``h`` is (..., D); targets and weights match its
    leading dimensions."""
    if chunk < 1:
        raise ValueError(f"kernels.loss_chunk_tokens: a chunk holds at least one token, got {chunk}")
    return LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), weights.reshape(-1),
                                    chunk, softcap)


class ChunkedLossHead(nn.Module):
    """In place of an LM head (``nn.Linear`` without bias, optionally with a ``softcap`` attribute): its forward
    returns the loss sum of the targets set with ``targets(...)`` instead of the logits."""

    def __init__(self, head: nn.Linear, chunk: int) -> None:
        super().__init__()
        if head.bias is not None:
            raise ValueError("kernels.loss_chunk_tokens: the chunked loss supports an LM head without bias")
        self.weight = head.weight  # the same parameter under the same name (lm_head.weight)
        self.softcap: float | None = getattr(head, "softcap", None)
        self.chunk = chunk
        self._targets: tuple[torch.Tensor, torch.Tensor] | None = None

    @contextlib.contextmanager
    def targets(self, targets: torch.Tensor, weights: torch.Tensor) -> Iterator[None]:
        """The next-token ids and loss weights (shaped like the head's input without its last dimension) of the
        forward run inside this block."""
        self._targets = (targets, weights)
        try:
            yield
        finally:
            self._targets = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            raise RuntimeError("kernels.loss_chunk_tokens: the model's head computes the loss; call it inside "
                               "ChunkedLossHead.targets(...)")
        targets, weights = self._targets
        return linear_cross_entropy(h, self.weight, targets, weights, chunk=self.chunk, softcap=self.softcap)


def install_chunked_loss(model: nn.Module, head_path: str, chunk: int) -> None:
    """Replace the LM head at ``head_path`` by a ``ChunkedLossHead`` (before any parallelism wraps the model)."""
    parent, _, name = head_path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    setattr(owner, name, ChunkedLossHead(getattr(owner, name), chunk))


def chunked_head(model: nn.Module) -> ChunkedLossHead | None:
    """The model's chunked loss head, or None when its head returns logits (or this pipeline stage has none)."""
    return next((m for m in model.modules() if isinstance(m, ChunkedLossHead)), None)
