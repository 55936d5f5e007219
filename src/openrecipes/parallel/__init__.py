"""The code that applies a parallel layout to a model (the layout itself lives in `openrecipes.config.layout`)."""

from openrecipes.config.layout import LayoutConfig, stage_layer_counts, validate_layout

__all__ = ["LayoutConfig", "stage_layer_counts", "validate_layout"]
