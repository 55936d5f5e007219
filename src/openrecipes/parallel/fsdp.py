"""Data parallelism with FSDP2: dense parameters (everything but the experts) sharded over the dp mesh.

Sharded parameters are the fp32 masters; with bf16 training, FSDP gathers them as bf16 for compute and reduces
gradients in fp32. A LoRA run's frozen base is sharded as it is stored, bf16, and gathered as is. Gradients are
summed, not averaged, over ranks: the loss is already divided by the global number of supervised tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from openrecipes.models.common.router import KeepFP32


def _sum_gradients(module: nn.Module) -> None:
    setter = getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
    setter(1.0)
    # a plain SUM (gloo has no pre-multiplied sum; dividing by 1 needs none)
    force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
    if force_sum is not None:
        force_sum(True)


def _shard_pinned_modules(layer: nn.Module, dense_mesh, ignored: set[nn.Parameter]) -> None:
    """Modules whose parameters the model pins to fp32 (``KeepFP32``: Muse Spark's router and residual gates) among
    bf16 ones: each becomes its own FSDP unit that gathers and computes in fp32, since the trained parameters of one
    unit share one dtype. (fp32 LoRA adapters on a frozen bf16 base stay in their layer's unit: its only trained
    parameters, gathered in bf16 for compute like the rest.)"""
    dtypes = {p.dtype for p in layer.parameters() if p not in ignored}
    if len(dtypes) < 2:
        return
    keep_fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for module in list(layer.modules()):
        own = [p for p in module.parameters(recurse=False) if p not in ignored]
        if module is not layer and own and isinstance(module, KeepFP32):
            fully_shard(module, mesh=dense_mesh, mp_policy=keep_fp32,
                        ignored_params={p for p in module.parameters() if p in ignored})
            _sum_gradients(module)


def apply_fsdp(model: nn.Module, layers: list[nn.Module], dense_mesh, *, compute_dtype: torch.dtype,
               ignored: set[nn.Parameter]) -> None:
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        _shard_pinned_modules(layer, dense_mesh, ignored)
        fully_shard(layer, mesh=dense_mesh, mp_policy=policy,
                    ignored_params={p for p in layer.parameters() if p in ignored})
        _sum_gradients(layer)
    fully_shard(model, mesh=dense_mesh, mp_policy=policy, ignored_params=ignored)
    _sum_gradients(model)
