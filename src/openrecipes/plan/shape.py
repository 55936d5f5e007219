"""The model shape the planner works on, from the model family's declaration (``ModelFamily.planner_shape``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from openrecipes.models.shape import ModelShape

__all__ = ["ModelShape", "model_shape"]


def model_shape(config: Any, *, name: str = "") -> ModelShape:
    from openrecipes.models.families import family_for_config

    try:
        family = family_for_config(config)
    except ValueError:
        raise ValueError(f"model: the planner does not know config type {type(config).__name__}") from None
    return dataclasses.replace(family.planner_shape(config, name), family=family.name)
