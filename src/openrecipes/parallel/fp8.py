"""The recipe's ``fp8`` section applied to a built model: which products run in FP8 (models/common/fp8.py).

Applied to the decoder layers only, after the weights exist and before tensor parallelism, recompute, compile and
FSDP2 wrap the modules (FSDP2 gathers an Fp8Linear's weight like any Linear's; the product then reads it in FP8).
The LM head, the embedding, the routers and any vision or audio tower keep their bf16 products.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from openrecipes.models.common.fp8 import FP8_EXPERTS, to_fp8
from openrecipes.models.families import ShardingPlan


def apply_fp8(layers: Iterable[nn.Module], plan: ShardingPlan, targets: Iterable[str]) -> int:
    """Put ``targets`` (``experts``, ``projections``) of ``layers`` in FP8; the number of products changed."""
    targets, changed = set(targets), 0
    for layer in layers:
        block = plan.moe_of(layer)
        if "experts" in targets and block is not None:
            block.experts.backend = FP8_EXPERTS
            changed += 1
        if "projections" in targets:
            for module in layer.modules():
                if type(module) is nn.Linear:  # routers are their own modules, the experts grouped parameters
                    to_fp8(module)
                    changed += 1
    return changed
