"""The kernel backends a model can run, and where each runs: plain names, so the model code (models/common) and the
recipe (config/recipe.py: ``Kernels``) read one list without the model importing the recipe."""

from __future__ import annotations

from typing import Literal, get_args

AttentionBackend = Literal["auto", "reference", "sdpa", "varlen", "flex"]
ExpertBackend = Literal["auto", "grouped_mm", "loop"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
EXPERT_BACKENDS: tuple[str, ...] = get_args(ExpertBackend)


def backend_runs(kind: str, backend: str, *, cuda: bool, bf16: bool) -> bool:
    """Whether ``backend`` (of ``kind``: attention or experts) can run on that device and precision: flash varlen
    attention and FlexAttention (whose backward has no CPU kernel) need CUDA, grouped_mm needs bf16 on CUDA; the others run anywhere."""
    if kind == "experts" and backend == "grouped_mm":
        return cuda and bf16
    if kind == "attention" and backend in ("varlen", "flex"):
        return cuda
    return True
