"""Data parallelism with FSDP2: dense parameters (everything but the experts) sharded over the dp mesh.

Sharded parameters are the fp32 masters; with bf16 training, FSDP gathers them as bf16 for compute and reduces
gradients in fp32. Gradients are summed, not averaged, over ranks: the loss is already divided by the global
number of supervised tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def _sum_gradients(module: nn.Module) -> None:
    setter = getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
    setter(1.0)
    # a plain SUM (gloo has no pre-multiplied sum; dividing by 1 needs none)
    force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
    if force_sum is not None:
        force_sum(True)


def apply_fsdp(model: nn.Module, layers: list[nn.Module], dense_mesh, *, compute_dtype: torch.dtype,
               ignored: set[nn.Parameter]) -> None:
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=dense_mesh, mp_policy=policy,
                    ignored_params={p for p in layer.parameters() if p in ignored})
        _sum_gradients(layer)
    fully_shard(model, mesh=dense_mesh, mp_policy=policy, ignored_params=ignored)
    _sum_gradients(model)
