"""openrecipes: tuned, verified, reproducible training recipes for Mixture-of-Experts models."""

from __future__ import annotations

from openrecipes.version import __version__

__all__ = ["__version__", "from_hf"]


def from_hf(path, *, dtype=None, device="cpu", full=False):
    """Load a Hugging Face checkpoint directory (config.json + safetensors) into the native model; ``full=True``
    loads a Muse Spark checkpoint's perception towers too (by default its text model alone)."""
    from openrecipes.checkpoint.hf import from_hf as _from_hf

    return _from_hf(path, dtype=dtype, device=device, full=full)
