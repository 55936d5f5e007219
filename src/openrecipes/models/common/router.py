"""Sigmoid top-k router with an FP32 weight and a frozen expert bias that steers selection only.

Legend: T tokens, D hidden, E experts, K experts per token.

- scores = sigmoid(x @ Wᵀ), computed in fp32 from an fp32 weight whatever the activation dtype;
- selection = top-k of (scores + expert_bias): the bias balances load by moving tokens between experts;
- gating weights = the *unbiased* scores of the selected experts, so the bias never scales an expert's output;
- with ``normalize_top_k`` (the default, our choice) the K weights are divided by their sum, so they add to one.
  Sigmoid scores are independent per expert, and without this the output's scale would follow the router's
  confidence; the published material does not say which is used.

The expert bias is a frozen parameter (``requires_grad=False``) rather than a buffer: it is part of the model's
state, and checkpoint import/export and ``named_parameters`` then carry it like every other tensor.

``KeepFP32`` pins a module's own parameters to fp32: ``.to(torch.bfloat16)`` moves them to the new device but
never lowers their precision (casting up to fp64 is allowed, for reference checks).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.moe import Routing, balanced


class KeepFP32(nn.Module):
    """Mixin: this module's own floating parameters (and their grads) never drop below fp32 in ``_apply``."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        own = {id(p) for p in self._parameters.values() if p is not None}
        own |= {id(p.grad) for p in self._parameters.values() if p is not None and p.grad is not None}

        def keep(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if id(t) in own and out.is_floating_point() and out.element_size() < 4:
                # Repeat the move from the source tensor so no value is ever rounded to the lower precision.
                return t.to(device=out.device, dtype=torch.float32)
            return out

        return super()._apply(keep, recurse)


class SigmoidTopKRouter(KeepFP32):
    """``forward(x_TD) -> Routing``; ``weight`` (E, D) fp32, ``expert_bias`` (E,) fp32 and frozen."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, normalize_top_k: bool = True,
                 balanced_routing: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.balanced_routing = balanced_routing  # KernelOptions.balanced_routing (benchmarks)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.expert_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)

    def scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Unbiased sigmoid scores (T, E) in fp32 (or fp64 when the weight is fp64)."""
        weight = self.weight
        compute = torch.promote_types(weight.dtype, torch.float32)
        return torch.sigmoid(F.linear(x_TD.to(compute), weight.to(compute)))

    def forward(self, x_TD: torch.Tensor) -> Routing:
        scores_TE = self.scores(x_TD)
        # The bias only reorders experts; detach keeps it out of autograd even if someone unfreezes it.
        _, experts_TK = torch.topk(scores_TE + self.expert_bias.detach().to(scores_TE.dtype), self.top_k, dim=-1)
        weights_TK = scores_TE.gather(-1, experts_TK)
        if self.normalize_top_k:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        routing = Routing(experts_TK=experts_TK, weights_TK=weights_TK.to(x_TD.dtype))
        return balanced(routing, self.weight.shape[0]) if self.balanced_routing else routing
