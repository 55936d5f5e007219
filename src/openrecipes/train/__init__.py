"""Training: the recipe (one config tree), the loop, metrics, checkpoints and launch."""
