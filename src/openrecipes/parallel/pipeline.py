"""Pipeline parallelism with torch.distributed.pipelining: each stage holds a contiguous run of decoder layers
(uneven first and last stages allowed), the first stage the embedding, the last the final norm and LM head; a 1F1B
schedule runs the microbatches.

A stage keeps the layer names of the whole model (layers are keyed by their global index), so its checkpoint keys are
the whole model's and a save under one pipeline layout loads under another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.attention import Documents


def prune_to_stage(model: nn.Module, layers: nn.ModuleDict, keep: range, *, first: bool, last: bool) -> None:
    """Drop what stage ``keep`` does not run: other layers, the embedding unless first, norm and head unless last."""
    for index in list(layers.keys()):
        if int(index) not in keep:
            del layers[index]
    backbone = next(m for m in model.modules() if hasattr(m, "embed_tokens") and hasattr(m, "norm"))
    if not first:
        backbone.embed_tokens = None
    if not last:
        backbone.norm = None
        model.lm_head = None


class StageModule(nn.Module):
    """What a pipeline stage runs: tensors in, tensors out (documents travel as ids and are rebuilt per stage).
    Checkpoints use the wrapped model itself, so its parameter names stay the whole model's."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        return self.model(x, position_ids, Documents.from_document_ids(document_ids))


class StageLoss:
    """Per-token loss of one microbatch on the last stage. ``target`` packs (next-token id, weight) in its last
    dimension; ``supervised_tokens`` (the global batch's count) is set before each step. Under sequence parallelism
    the logits cover this rank's slice of the sequence, and ``sequence_slice`` cuts the targets to match."""

    def __init__(self, sequence_slice=None) -> None:
        self.supervised_tokens = 1.0
        self.sequence_slice = sequence_slice

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.sequence_slice is not None:
            target = self.sequence_slice(target)
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target[..., 0].reshape(-1),
                                    reduction="none")
        return (per_token * target[..., 1].reshape(-1).to(per_token.dtype)).sum() / self.supervised_tokens


def build_schedule(stage_module: StageModule, *, stage_index: int, num_stages: int, device: torch.device,
                   group, microbatches: int, loss_fn):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if microbatches < num_stages:
        raise ValueError(f"layout: pp={num_stages} needs at least {num_stages} microbatches per step on each "
                         f"data-parallel rank, got {microbatches} (raise global_batch or lower "
                         "layout.max_tokens_per_gpu)")
    stage = PipelineStage(stage_module, stage_index, num_stages, device, group=group)
    return Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
