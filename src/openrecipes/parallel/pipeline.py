"""Pipeline parallelism with torch.distributed.pipelining: each stage holds a contiguous run of decoder layers
(uneven first and last stages allowed), the first stage the embedding, the last the final norm and LM head; a 1F1B
schedule runs the microbatches.

Interleaved (``vpp > 1``): each rank holds ``vpp`` chunks of layers, rank ``r`` the virtual stages ``r, r + pp, ...``
(config/layout.py ``virtual_stage_layers``), and the interleaved 1F1B schedule runs them. The rank keeps one model
holding all its chunks' layers (so the optimizer, the gradient sums and the checkpoints see one module, as without
interleaving); each chunk's stage runs its own layers of it.

A stage keeps the layer names of the whole model (layers are keyed by their global index), so its checkpoint keys are
the whole model's and a save under one pipeline layout loads under another, interleaved or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection

import torch
from torch import nn

from openrecipes.config.layout import LayoutError, ParallelSizes, pipeline_microbatch_problems
from openrecipes.models.common.attention import Documents
from openrecipes.models.families import ShardingPlan
from openrecipes.parallel.compile import dynamic_document_count

if TYPE_CHECKING:
    from openrecipes.parallel.lone_stage import StageShapes


def prune_to_stage(model: nn.Module, plan: ShardingPlan, keep: Collection[int], *, first: bool, last: bool) -> None:
    """Drop what this rank's stage(s) do not run: layers not in ``keep``, the embedding unless it holds the first
    stage, norm and head unless it holds the last."""
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
    ``layers``: the chunk's decoder layers when the rank's model holds several chunks (interleaved), else None (all it
    holds). Checkpoints use the wrapped model itself, so its parameter names stay the whole model's."""

    def __init__(self, model: nn.Module, layers: range | None = None, *, runs_head: bool = False,
                 loss_inputs=None) -> None:
        super().__init__()
        self.model = model
        self.layers = layers
        # when the last stage's head computes the loss itself: target -> the ``with`` block it reads them in
        self.loss_inputs = loss_inputs if runs_head else None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor,
                loss_target: torch.Tensor | None = None, image_pixels: torch.Tensor | None = None,
                image_grids: torch.Tensor | None = None, image_held: torch.Tensor | None = None) -> torch.Tensor:
        documents = Documents.from_document_ids(document_ids)
        # decided per microbatch here: a compiled block sees each case once
        documents = None if documents.whole_rows(*document_ids.shape) else dynamic_document_count(documents)
        chunk = {} if self.layers is None else {"layers": self.layers}
        if position_ids.dim() == 3:  # (B, axes, T) travels split by rows; the model takes (axes, B, T)
            position_ids = position_ids.transpose(0, 1)
        if image_grids is not None and not torch.is_floating_point(x):  # the stage that embeds the tokens
            chunk.update(unpad_images(image_pixels, image_grids, image_held))
        if self.loss_inputs is None or loss_target is None:
            return self.model(x, position_ids, documents, **chunk)
        with self.loss_inputs(loss_target):
            # one element, not a scalar: the schedule concatenates the microbatches' outputs
            return self.model(x, position_ids, documents, **chunk).reshape(1)


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Our handles to this rank's stages (one per chunk), their schedule, its microbatches per step and the loss the
    last stage computes."""

    stages: list[Any]
    schedule: Any
    microbatches: int
    loss: Any

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage (it feeds the token ids)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return any(stage.is_last for stage in self.stages)


def build_pipeline(model: nn.Module, chunks: list[tuple[int, range]], *, num_stages: int, device: torch.device,
                   group, microbatches: int, loss_fn, loss_inputs=None) -> Pipeline:
    """The stages of this rank's ``chunks`` ((virtual stage index, layers), config/layout.py ``rank_layers``) over
    ``num_stages`` virtual stages: 1F1B for one chunk per rank, interleaved 1F1B for several. ``loss_inputs``: when
    the head computes the loss (a chunked loss), how the last stage hands it the targets."""
    from torch.distributed.pipelining import PipelineStage

    ranks = num_stages // len(chunks)
    problems = pipeline_microbatch_problems(ParallelSizes(pp=ranks, vpp=len(chunks)), microbatches)
    if problems:  # the layout rule train applies first; here for a caller that did not
        raise LayoutError(problems[0])
    # one chunk: the stage runs all the model holds; several: each its own layers of it
    stages = [PipelineStage(StageModule(model, None if len(chunks) == 1 else layers,
                                        runs_head=index == num_stages - 1, loss_inputs=loss_inputs),
                            index, num_stages, device, group=group) for index, layers in chunks]
    return Pipeline(stages=stages, schedule=_schedule(stages, microbatches, loss_fn), microbatches=microbatches,
                    loss=loss_fn)


def _schedule(stages: list[Any], microbatches: int, loss_fn) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    if len(stages) == 1:
        return Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def run_alone(pipeline: Pipeline, shapes: StageShapes, *, seed: int = 0) -> Pipeline:
    """``pipeline`` with each stage a ``LoneStage`` (parallel/lone_stage.py) of ``shapes``: the same modules, stage
    indices and schedule, for one rank run alone under the fake process group, where nothing arrives from the
    neighbouring stages."""
    from openrecipes.parallel.lone_stage import LoneStage

    stages = [LoneStage(stage.submod, stage.stage_index, stage.num_stages, stage.device, shapes=shapes,
                        group=stage.group, seed=seed) for stage in pipeline.stages]
    return Pipeline(stages=stages, schedule=_schedule(stages, pipeline.microbatches, pipeline.loss),
                    microbatches=pipeline.microbatches, loss=pipeline.loss)


def unpad_images(pixels_BPC: torch.Tensor, grids_BK3: torch.Tensor, held_BK2: torch.Tensor) -> dict[str, torch.Tensor]:
    """A pipelined microbatch's images, which travel padded per row (so the schedule can split them by rows), as the
    model's image keywords: each row's images (grids with t > 0) in order, their patches at the start of its row."""
    pixels, grids, held = [], [], []
    for row_pixels, row_grids, row_held in zip(pixels_BPC, grids_BK3, held_BK2):
        valid = row_grids[:, 0] > 0
        patches = int(row_grids[valid].prod(dim=1).sum())
        pixels.append(row_pixels[:patches])
        grids.append(row_grids[valid])
        held.append(row_held[valid])
    if not torch.cat(grids).numel():
        return {}
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids), "image_tokens_held": torch.cat(held)}
