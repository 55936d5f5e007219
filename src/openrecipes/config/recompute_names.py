"""The recompute granularities, as plain names: the recipe (config/recipe.py: ``Recompute``), the planner and the
command line read one list without importing pydantic or torch.

none: keep every activation; selective: the attention block; full: the whole layer; full_keep_attention: the whole
layer but the attention kernel, whose inputs, output and softmax statistics are kept; attention_core: the attention
kernel alone; experts: the routed experts alone."""

from __future__ import annotations

from typing import Literal, get_args

RecomputeGranularity = Literal["none", "selective", "full", "full_keep_attention", "attention_core", "experts"]
RECOMPUTE_GRANULARITIES: tuple[str, ...] = get_args(RecomputeGranularity)
WHOLE_LAYER_GRANULARITIES = ("full", "full_keep_attention")  # the layer keeps its input and is rebuilt from it
