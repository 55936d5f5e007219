"""The multi-token-prediction loss (recipe ``mtp``; DeepSeek-V3 report §2.2, Megatron-LM's multi_token_prediction.py).

Depth k = 1..D of the model's MTP layers gives, at position i, a representation h^k_i (the model's forward with
``mtp=True``); the main model's LM head turns it into logits for token t_(i+k+1), k + 1 places ahead. Its targets
follow the main loss's rule (``engine.loss_weights``: the loss mask of the target, never across a document start),
k places further on:

    weight_k(i) = loss_mask(i+k+1) · [no document starts at i+1, ..., i+k+1] (position_ids != 0 there),
                  and 0 where i+k+1 is past the row's end

so a position whose target lies in the next document, or past the row, or is not a supervised token, adds nothing.
The step's objective is

    main loss sum / N  +  loss_weight / D · Σ_k (Σ_i weight_k(i) · CE(head(h^k_i), t_(i+k+1))) / N_k

with N and N_k the supervised targets of the main loss and of depth k in the global batch (per-token losses, as the
main loss; a depth without any target adds 0): under data parallelism N_k, like N, is summed over the ranks' rows.
Rows go whole to a rank, so each rank's targets follow the one-process rule. The metric ``mtp_loss`` is the mean
over the depths of their per-token losses, without the weight, comparable with ``loss``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

# (hidden (B, T, D), targets (B, T), weights (B, T)) -> Σ weight · cross entropy of the head's logits, fp32
HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def mtp_targets(batch: dict[str, torch.Tensor], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets t_(i+depth+1) and their weights (the module docstring) of every position, each (B, T)."""
    shift = depth + 1
    input_ids, positions, mask = batch["input_ids"], batch["position_ids"], batch["loss_mask"]
    tokens = input_ids.shape[1]
    weights = torch.zeros(mask.shape, dtype=mask.dtype, device=mask.device)
    if shift < tokens:
        kept = mask[:, shift:].clone()
        for j in range(1, shift + 1):  # every token from i+1 to i+depth+1 in i's document
            kept = kept * (positions[:, j:tokens - shift + j] != 0)
        weights[:, :tokens - shift] = kept
    return torch.roll(input_ids, -shift, dims=1), weights


class MtpObjective:
    """One step's MTP term: the depths' supervised targets counted over the step's microbatches up front, then each
    microbatch's term (``add``), taken by the loop beside its main loss (``take``). ``group``: the data-parallel
    ranks, whose rows the counts and the metric's sums add up over (None: this process holds the whole batch)."""

    def __init__(self, loss_weight: float, depths: int, microbatches: list[dict[str, torch.Tensor]],
                 device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.loss_weight, self.depths, self.group = loss_weight, depths, group
        counts = torch.tensor([sum(float(mtp_targets(b, k)[1].sum()) for b in microbatches)
                               for k in range(1, depths + 1)], dtype=torch.float64, device=device)
        if group is not None:
            dist.all_reduce(counts, group=group)
        self.counts = counts.tolist()
        self.sums = torch.zeros(depths, dtype=torch.float64, device=device)
        self._pending: torch.Tensor | None = None

    def add(self, hidden: list[torch.Tensor], batch: dict[str, torch.Tensor], head_loss: HeadLoss) -> None:
        """The microbatch's term from the depths' representations (``hidden``, one (B, T, D) per depth)."""
        if len(hidden) != self.depths:
            raise ValueError(f"mtp: the model returned {len(hidden)} depths, expected {self.depths}")
        term = torch.zeros((), dtype=torch.float32, device=self.sums.device)
        for k, h in enumerate(hidden, start=1):
            targets, weights = mtp_targets(batch, k)
            loss_sum = head_loss(h, targets, weights)
            self.sums[k - 1] += loss_sum.detach().double()
            if self.counts[k - 1]:
                term = term + loss_sum / self.counts[k - 1]
        self._pending = term * (self.loss_weight / self.depths)

    def take(self) -> torch.Tensor:
        """The term ``add`` computed for the last microbatch (to add to its objective)."""
        if self._pending is None:
            raise RuntimeError("mtp: no microbatch term to take (the forward did not run the MTP layers)")
        term, self._pending = self._pending, None
        return term

    def per_token_loss(self) -> float:
        """The metric ``mtp_loss``: the mean over the depths with targets of their per-token losses (a collective
        over ``group``)."""
        sums = self.sums.clone()
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        losses = [s / n for s, n in zip(sums.tolist(), self.counts) if n]
        return sum(losses) / len(losses) if losses else float("nan")
