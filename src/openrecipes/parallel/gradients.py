"""Gradients of a parallelized model: fp32 accumulation over microbatches, synchronisation over the parallel groups,
the global norm and clipping. The state lives in a ``GradientSync`` object, never as flags on the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from openrecipes.parallel.collectives import ReplicatedGradSum


class GradientSync:
    """How one model's gradients accumulate and synchronise.

    bf16 parameters fold each backward's gradient into an fp32 ``main_grad`` (a post-accumulate hook) and free the
    bf16 one, so accumulation over microbatches happens in fp32 and only one bf16 gradient lives at a time. With a
    single microbatch per step nothing needs accumulating: the bf16 gradient stays in place (the optimizer upcasts
    it as it reads), which saves a full pass over the gradients.
    """

    def __init__(self, model: nn.Module, parallel: Any, *, tp_sharded_names: frozenset[str] = frozenset(),
                 fp32_accumulation: bool = False) -> None:
        self.model, self.parallel = model, parallel
        self.tp_sharded_names = tp_sharded_names  # by name: FSDP later replaces the parameter objects
        self.fold_grads = fp32_accumulation
        self.fp32_accumulation = fp32_accumulation
        if fp32_accumulation:
            self._attach_fp32_accumulators()
        # weights whole on every rank of a TP or CP group saw only that rank's tokens: their sums over the group
        # (TP's shards too over CP: the cp ranks hold the same shard). Built after the accumulators, so their hooks
        # read the step's whole gradient.
        self.replicated_sums: list[ReplicatedGradSum] = []
        if parallel.tp_size > 1:
            self.replicated_sums.append(ReplicatedGradSum(model, self.replicated_parameters,
                                                          parallel.tp_mesh.get_group()))
        if parallel.cp_size > 1:
            self.replicated_sums.append(ReplicatedGradSum(
                model, lambda: self.replicated_parameters(include_tp_shards=True), parallel.cp_mesh.get_group()))

    def _attach_fp32_accumulators(self) -> None:
        for param in self.model.parameters():
            if param.dtype == torch.float32 or not param.requires_grad:
                continue
            param.main_grad = None
            param.register_post_accumulate_grad_hook(self._fold)

    def _fold(self, param: torch.Tensor) -> None:
        if not self.fold_grads and param.main_grad is None:
            return
        if param.main_grad is None:
            param.main_grad = param.grad.float()
        else:
            param.main_grad.add_(param.grad)
        param.grad = None

    def begin_step(self, microbatches: int) -> None:
        self.fold_grads = self.fp32_accumulation and microbatches > 1

    def before_backward(self, *, last: bool) -> None:
        """Before a microbatch's backward: on the step's ``last`` one, start the replicated gradients' sums during it
        (with both TP and CP a weight is summed over two groups, one after the other: those wait for the end)."""
        if len(self.replicated_sums) == 1:
            self.replicated_sums[0].arm(last)

    def after_backward(self) -> None:
        """After each microbatch's backward: fold the gradients FSDP2 wrote (the hooks fold the others)."""
        if self.fold_grads:
            for param in self.model.parameters():
                if param.grad is None or param.grad.dtype == torch.float32:
                    continue
                main_grad = getattr(param, "main_grad", None)
                if main_grad is None:
                    param.main_grad = param.grad.float()
                else:
                    main_grad.add_(param.grad)
                param.grad = None

    def synchronize(self) -> None:
        """Sum what the backward left partial: expert gradients over edp (and a LoRA expert adapter's factor that is
        whole over etp over etp), replicated weights over TP and CP."""
        parallel = self.parallel
        if parallel.expert_mesh is not None:
            from openrecipes.parallel.expert import all_reduce_expert_grads

            all_reduce_expert_grads(self.model, parallel.expert_mesh)
        for replicated_sum in self.replicated_sums:  # finishing the sums started during the backward
            replicated_sum.finish()

    def replicated_parameters(self, *, include_tp_shards: bool = False) -> list[nn.Parameter]:
        """Parameters whole on every rank of the TP (or CP) group, in the same order on every rank (with
        ``include_tp_shards``, TP's shards too: they are the same on every rank of a CP group). FSDP may still shard
        them over dp; expert-parallel experts are left out (their gradients are summed over edp instead)."""
        sharded = frozenset() if include_tp_shards else self.tp_sharded_names
        return [p for n, p in self.model.named_parameters()
                if p.requires_grad and n not in sharded and not _expert_parallel(p)]

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: the fp32 accumulator where one is kept, else ``.grad`` (maybe a DTensor)."""
        return [g for g in (_gradient(p) for p in self.model.parameters()) if g is not None]

    def zero(self) -> None:
        for param in self.model.parameters():
            param.grad = None
            if hasattr(param, "main_grad"):
                param.main_grad = None


def _gradient(param: torch.Tensor) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def _expert_parallel(param: nn.Parameter) -> bool:
    return isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())


def grad_norm_squared(grads: list[torch.Tensor], device: torch.device, *, stage_group=None) -> torch.Tensor:
    """The squared global L2 norm of ``grads``, in fp64 on ``device``, never read back to the host: the step's
    clip factor and its finiteness are computed from it on the device, so the optimizer's launches queue behind the
    backward instead of waiting for it.

    Sharded (DTensor) gradients add their squared local norms over the ranks of the mesh dimension they are
    sharded on; pipeline stages (``stage_group``) hold different layers and add theirs."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        group = None
        if isinstance(grad, DTensor):
            # "not replicated" rather than is_shard(): FSDP2 over TP uses _StridedShard, which is_shard() denies
            group = tuple(grad.device_mesh.get_group(i) for i, placement in enumerate(grad.placements)
                          if not placement.is_replicate())
            grad = grad.to_local()
        groups.setdefault(group, []).append(grad)
    norm_sq = torch.zeros((), dtype=torch.float64, device=device)
    for group, tensors in groups.items():
        # one stack and one cast: a cast per tensor was a kernel launch each, with the GPU idle behind them
        group_sq = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).double().pow(2).sum()
        for mesh_group in group or ():  # sharded over several mesh dims: sum over each in turn
            dist.all_reduce(group_sq, group=mesh_group)
        norm_sq = norm_sq + group_sq
    if stage_group is not None:
        dist.all_reduce(norm_sq, group=stage_group)
    return norm_sq


def clip_scale(norm: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """The fp32 factor that clips a gradient of norm ``norm`` to ``max_norm`` (1.0 when it is within, or not
    finite), on ``norm``'s device. The optimizer applies it as it reads each gradient (no extra pass)."""
    if max_norm is None:
        return torch.ones((), dtype=torch.float32, device=norm.device)
    return torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0).float()
