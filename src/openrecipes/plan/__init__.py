"""Planner: predict per-stage memory, fit, tokens/s/GPU and MFU of a layout before it runs."""
