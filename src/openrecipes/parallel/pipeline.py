"""Pipeline parallelism with torch.distributed.pipelining: each stage holds a contiguous run of decoder layers
(uneven first and last stages allowed), the first stage the embedding, the last the final norm and LM head; a 1F1B
schedule runs the microbatches.

A stage keeps the layer names of the whole model (layers are keyed by their global index), so its checkpoint keys are
the whole model's and a save under one pipeline layout loads under another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from openrecipes.models.common.attention import Documents
from openrecipes.models.families import ShardingPlan


def prune_to_stage(model: nn.Module, plan: ShardingPlan, keep: range, *, first: bool, last: bool) -> None:
    """Drop what stage ``keep`` does not run: other layers, the embedding unless first, norm and head unless last."""
    layers = plan.layer_dict(model)
    for index in list(layers.keys()):
        if int(index) not in keep:
            del layers[index]
    if not first:
        plan.drop(model, plan.embedding)
    if not last:
        plan.drop(model, plan.final_norm)
        plan.drop(model, plan.lm_head)


class StageModule(nn.Module):
    """What a pipeline stage runs: tensors in, tensors out (documents travel as ids and are rebuilt per stage).
    Checkpoints use the wrapped model itself, so its parameter names stay the whole model's."""

    def __init__(self, model: nn.Module, loss_inputs=None) -> None:
        super().__init__()
        self.model = model
        # when the last stage's head computes the loss itself: target -> the ``with`` block it reads them in
        self.loss_inputs = loss_inputs

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor,
                loss_target: torch.Tensor | None = None) -> torch.Tensor:
        documents = Documents.from_document_ids(document_ids)
        if self.loss_inputs is None or loss_target is None:
            return self.model(x, position_ids, documents)
        with self.loss_inputs(loss_target):
            # one element, not a scalar: the schedule concatenates the microbatches' outputs
            return self.model(x, position_ids, documents).reshape(1)


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Our handles to this rank's stage, its schedule and the loss the last stage computes."""

    stage: Any
    schedule: Any
    loss: Any


def build_pipeline(stage_module: StageModule, *, stage_index: int, num_stages: int, device: torch.device,
                   group, microbatches: int, loss_fn) -> Pipeline:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if microbatches < num_stages:
        raise ValueError(f"layout: pp={num_stages} needs at least {num_stages} microbatches per step on each "
                         f"data-parallel rank, got {microbatches} (raise global_batch or lower "
                         "layout.max_tokens_per_gpu)")
    stage = PipelineStage(stage_module, stage_index, num_stages, device, group=group)
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(stage=stage, schedule=schedule, loss=loss_fn)
