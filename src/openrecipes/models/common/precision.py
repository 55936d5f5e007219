"""The parameters a model pins to fp32 (``KeepFP32`` modules), and a check that they really are fp32.

``KeepFP32`` protects these tensors from ``.to(dtype)``, but code that replaces ``param.data`` (a loader, a
hand-written cast) goes around it. ``check_fp32_parameters`` is the guard a training run calls once its model is
built: it fails, naming every offending tensor, before a single step can round the router or a residual gate.
"""

from __future__ import annotations

import torch
from torch import nn

from openrecipes.models.common.router import KeepFP32


def fp32_parameter_names(model: nn.Module) -> list[str]:
    """Names of the floating parameters owned by ``KeepFP32`` modules (e.g. router weight, expert bias,
    residual gates), in ``named_parameters`` order."""
    pinned = {id(param) for module in model.modules() if isinstance(module, KeepFP32)
              for param in module.parameters(recurse=False)}
    return [name for name, param in model.named_parameters()
            if id(param) in pinned and param.is_floating_point()]


def check_fp32_parameters(model: nn.Module) -> None:
    """Raise ValueError naming every fp32-pinned parameter stored below fp32 (fp64 is allowed: reference checks)."""
    params = dict(model.named_parameters())
    wrong = [f"{name} ({str(params[name].dtype).removeprefix('torch.')})" for name in fp32_parameter_names(model)
             if torch.finfo(params[name].dtype).bits < 32]
    if wrong:
        raise ValueError(f"{len(wrong)} parameter(s) must be fp32 but are not: {', '.join(wrong[:6])}"
                         f"{' and more' if len(wrong) > 6 else ''}. A loader replaced their data in a lower "
                         "precision; build or load the model so that KeepFP32 tensors stay fp32")
