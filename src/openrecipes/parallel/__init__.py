"""Parallel layouts and (later) the code that applies them to a model."""

from openrecipes.parallel.layout import LayoutConfig, stage_layer_counts, validate_layout

__all__ = ["LayoutConfig", "stage_layer_counts", "validate_layout"]
