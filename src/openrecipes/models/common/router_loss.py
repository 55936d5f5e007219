"""The router load-balancing auxiliary loss, as transformers computes it for Qwen3-MoE (``load_balancing_loss_func``).

Over one forward through L MoE layers of N tokens (E experts, top-K routing):

    f_e  = (sum over layers of the token copies routed to expert e) / (L * N)    no gradient; sums to K
    P_e  = (sum over layers and tokens of the router's softmax probability of e) / (L * N)
    loss = E * sum_e f_e * P_e

The layers are pooled before the product (one f and one P over every layer), as transformers does, rather than one
loss per layer summed (Megatron's form). With a token mask (transformers' ``attention_mask``) only tokens with mask 1
count, in N too; without one every token counts, padding included — so packed training rows, which carry no padding
mask, are judged over all their tokens, exactly as a transformers forward without ``attention_mask`` would be.

What N pools over: transformers pools every token of its forward's batch (``rows=None`` here). Training pools each
row on its own (``rows=B``: one loss per row, as a transformers forward on that row alone computes): microbatches
hold whole rows, so the step's loss — the mean over the global batch's rows — is then the same under every data and
expert parallel layout and microbatch size, as a layout must leave the numbers unchanged.

Two details differ from transformers only in rounding: the probabilities are the router's own fp32 softmax
(transformers takes the softmax in the logits' dtype, the same in fp32), and f counts the experts the router really
chose (transformers repeats the top-k on those probabilities, which picks the same experts in fp32).

Usage (the statistics are gathered only inside the ``with``: activation recompute, which reruns layers during the
backward, adds nothing)::

    with RouterStatistics(model) as routing:
        logits = model(input_ids)
    loss = cross_entropy + coef * routing.load_balancing_loss()
"""

from __future__ import annotations

import torch
from torch import nn

from openrecipes.models.common.moe import SoftmaxTopKRouter


class RouterStatistics:
    """Sums the routing of every ``SoftmaxTopKRouter`` of ``model`` over one forward (see the module docstring).

    ``token_mask`` (B, T) of 0/1, optional: the tokens that count. ``rows``: None pools every token of the forward;
    an int splits the forward's tokens into that many equal consecutive groups (the rows of a (rows, T) input), each
    pooled on its own.
    """

    def __init__(self, model: nn.Module, *, token_mask: torch.Tensor | None = None, rows: int | None = None) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, SoftmaxTopKRouter)]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no softmax top-k router: the load-balancing loss is "
                             "defined for softmax routers (Qwen3-MoE) only")
        self.token_mask = token_mask
        self.groups = rows or 1
        # (probs_TE, experts_TK) of each layer, reduced on first use. Nothing is computed during the forward: inside
        # an activation-recomputed layer any op that saves a tensor would differ between the forward and its rerun.
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layers = 0
        self._sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __enter__(self) -> "RouterStatistics":
        for router in self.routers:
            router.statistics = self
        return self

    def __exit__(self, *exc) -> None:
        for router in self.routers:
            router.statistics = None

    def record(self, probs_TE: torch.Tensor, experts_TK: torch.Tensor) -> None:
        """One layer's routing: the softmax over all experts (T, E) and the experts chosen (T, K)."""
        if self._sums is not None:
            raise ValueError("RouterStatistics already reduced: use a new one for each forward")
        self.recorded.append((probs_TE, experts_TK))
        self.layers += 1

    def _reduce(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens per expert (G, E), probability sums (G, E), tokens (G,)), summed over layers; the layers'
        tensors are released once summed."""
        if self._sums is not None:
            return self._sums
        if not self.recorded:
            raise ValueError("no routing was recorded: run the model's forward inside `with RouterStatistics(...)`")
        counts_GE = probs_GE = tokens_G = None
        for probs_TE, experts_TK in self.recorded:
            (tokens, num_experts), top_k, groups = probs_TE.shape, experts_TK.shape[-1], self.groups
            if tokens % groups:
                raise ValueError(f"the router saw {tokens} tokens, which do not split into {groups} equal rows")
            if self.token_mask is None:
                weight_GT = probs_TE.new_ones((groups, tokens // groups), dtype=torch.float32)
            elif self.token_mask.numel() != tokens:
                raise ValueError(f"token_mask has {self.token_mask.numel()} tokens, the router saw {tokens}")
            else:
                weight_GT = self.token_mask.reshape(groups, -1).to(device=probs_TE.device, dtype=torch.float32)
            layer_counts_GE = weight_GT.new_zeros((groups, num_experts)).scatter_add_(
                1, experts_TK.reshape(groups, -1), weight_GT.repeat_interleave(top_k, dim=1))
            layer_probs_GE = (probs_TE.float().view(groups, -1, num_experts) * weight_GT.unsqueeze(-1)).sum(dim=1)
            layer_tokens_G = weight_GT.sum(dim=1)
            if counts_GE is None:
                counts_GE, probs_GE, tokens_G = layer_counts_GE, layer_probs_GE, layer_tokens_G
            else:
                counts_GE, probs_GE = counts_GE + layer_counts_GE, probs_GE + layer_probs_GE
                tokens_G = tokens_G + layer_tokens_G
        self.recorded.clear()
        self._sums = (counts_GE, probs_GE, tokens_G)
        return self._sums

    def losses(self) -> torch.Tensor:
        """E * sum_e f_e * P_e of each group (rows,) — or (1,) when pooling the whole forward — over every layer
        recorded, fp32, carrying the router's gradient."""
        counts_GE, probs_GE, tokens_G = self._reduce()
        tokens_G1 = tokens_G.unsqueeze(-1)
        return probs_GE.shape[-1] * ((counts_GE / tokens_G1) * (probs_GE / tokens_G1)).sum(dim=-1)

    def load_balancing_loss(self) -> torch.Tensor:
        """The mean of ``losses()``: transformers' loss over the forward when pooling all of it."""
        return self.losses().mean()
