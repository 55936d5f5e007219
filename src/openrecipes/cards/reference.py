"""Reference data the card checks need, read from where the project keeps it: GPU peaks and instance prices
from the measurement package's hardware table, layer counts and the sizes the layout rules check from the model
registry."""

from __future__ import annotations

from functools import lru_cache

from openrecipes.config.layout import LayoutModel

# USD per GPU-hour a card's implied price must fall in when its instance has no price in the hardware table
PLAUSIBLE_PRICE_BAND: dict[str, tuple[float, float]] = {
    "H100": (0.5, 15.0),
    "H200": (0.5, 15.0),
}

# published model names -> registry names, where they differ beyond case and spaces
_MODEL_ALIASES = {"muse-spark-open": "muse-spark-open-816b-a42b"}


@lru_cache(maxsize=1)
def _hardware():
    from openrecipes.config.hardware import load_hardware

    return load_hardware()


def peak_flops(gpu_type: str) -> float | None:
    spec = _hardware().gpus.get(gpu_type.strip().upper())
    return spec.peak_bf16_dense_flops if spec else None


def price_for_instance(instance: str | None) -> float | None:
    if instance is None:
        return None
    spec = _hardware().instances.get(instance.strip())
    return spec.usd_per_gpu_hour if spec else None


def _registered_config(model: str):
    from openrecipes.models.registry import get_config, names

    name = model.strip().lower().replace(" ", "-")
    name = _MODEL_ALIASES.get(name, name)
    return get_config(name) if name in names() else None


def model_layers(model: str) -> int | None:
    config = _registered_config(model)
    return config.num_hidden_layers if config else None


def model_layout(model: str) -> LayoutModel:
    """The sizes the layout rules check of a registered model; none for a model the registry does not know."""
    from openrecipes.models.families import family_for_config

    config = _registered_config(model)
    return family_for_config(config).planner_shape(config, model).layout_model() if config else LayoutModel()
