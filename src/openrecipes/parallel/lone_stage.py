"""A pipeline stage run as one rank alone, under the fake process group (train/rank_measure.py): its neighbours'
sends are never delivered, so what they would deliver is given here, with the shapes the real job's stages agree on.

torch.distributed.pipelining learns what crosses between stages in one of two ways. Without shapes given up front it
runs one forward and backward and exchanges the resulting shapes with its neighbours (``send_object_list``), which the
fake group answers with garbage; with every stage's shapes given it skips that, but only after a vote over the
pipeline group (``_warmup_forward_vote``) that every stage has them, and a fake receive leaves that vote at "no". A
lone stage therefore is given its shapes, answers the vote itself, and fills the buffers the fake receives leave
untouched (the activations from the previous stage, the gradients from the next) with finite values, once, as their
first receive is posted: they are the same buffers at every step, as in the real job, and a receive that does deliver
(a replay of the real rank's, tests/distributed/test_rank_replay.py) overwrites them. The schedule itself (its order,
its microbatches in flight) is torch's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage


@dataclass(frozen=True)
class StageShapes:
    """What crosses between stages for one microbatch: the first stage's token ids (its positional input) and the
    hidden states every later stage receives and every stage but the last sends (the residual stream of this rank:
    its context- and sequence-parallel slice of the rows)."""

    token_ids: tuple[int, ...]
    hidden: tuple[int, ...]
    dtype: torch.dtype


class LoneStage(PipelineStage):
    """A ``PipelineStage`` whose neighbours are assumed, not heard (see the module's docstring). Counts the
    microbatches it runs forward and backward and the most it held at once (forwarded, not yet backwarded)."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device, *,
                 shapes: StageShapes, group=None, seed: int = 0) -> None:
        hidden = torch.empty(shapes.hidden, dtype=shapes.dtype, device="meta", requires_grad=True)
        first, last = stage_index == 0, stage_index == num_stages - 1
        inputs = torch.empty(shapes.token_ids, dtype=torch.long, device="meta") if first else hidden
        # the last stage sends nothing: its output's shape is never read, only required to be given
        outputs = torch.empty(1, device="meta") if last else hidden
        super().__init__(submodule, stage_index, num_stages, device, input_args=inputs, output_args=outputs,
                         group=group)
        # the shapes above are an assumption: torch checks each microbatch's tensors against them. Not on the last
        # stage: its inputs are the buffers made from these very shapes, and torch before 2.13 also checks its
        # output (the logits) against the placeholder above (Muse Spark's last stage on an H100, torch 2.11)
        self._runtime_validate = not last
        self._generator = torch.Generator(device).manual_seed(seed)
        self._filled: set[int] = set()
        self.forwards = self.backwards = self.most_in_flight = 0

    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        from torch.distributed.pipelining._utils import InferenceMode

        if InferenceMode.needs_dynamic(self._user_meta, has_backward):
            raise ValueError(f"pipeline stage {self.stage_index}: its shapes do not suffice for torch's pipeline to "
                             "skip exchanging them, which one rank alone cannot")
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32, device=self.device)

    # filled before the receive, not before the compute: what a receive delivers is what the stage computes on
    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        if not self.is_first:  # an activation of the scale of the residual stream
            self._fill(self.args_recv_info[fwd_chunk_id], std=1.0)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if not self.is_last and self.has_backward:
            # a loss averaged over the step's tokens gives each hidden element a gradient of about 1 / tokens
            self._fill(self.grad_recv_info[bwd_chunk_id], std=None)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.forwards += 1
        self.most_in_flight = max(self.most_in_flight, self.forwards - self.backwards)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        result = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self.backwards += 1
        return result

    def _fill(self, infos, *, std: float | None) -> None:
        for info in infos:
            buffer = info.buffer
            if buffer is None or id(buffer) in self._filled:
                continue
            with torch.no_grad():
                buffer.normal_(0.0, std if std is not None else 1.0 / buffer[..., 0].numel(),
                               generator=self._generator)
            self._filled.add(id(buffer))
