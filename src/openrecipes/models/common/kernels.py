"""Which kernels a model runs, chosen when it is built (``build(config, kernels=...)``), never by a global."""

from __future__ import annotations

from dataclasses import dataclass

from openrecipes.config.kernel_names import ATTENTION_BACKENDS, EXPERT_BACKENDS


@dataclass(frozen=True, kw_only=True)
class KernelOptions:
    """``attention``: see common/attention.py. ``experts``: ``auto`` is grouped_mm for bf16 on CUDA, else the exact
    per-expert loop. ``balanced_routing`` routes token copies round-robin over the experts (every expert gets the
    same load; the router still runs and its gating weights still get gradients): for benchmarks only."""

    attention: str = "auto"
    experts: str = "auto"
    balanced_routing: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"kernels.attention: unknown backend {self.attention!r}; expected one of "
                             f"{ATTENTION_BACKENDS}")
        if self.experts not in EXPERT_BACKENDS:
            raise ValueError(f"kernels.experts: unknown backend {self.experts!r}; expected one of {EXPERT_BACKENDS}")
