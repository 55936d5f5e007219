"""Reference data the card checks need, read from where the project keeps it: GPU peaks and instance prices
from the measurement package's hardware table, layer counts and the sizes the layout rules check from the model
registry."""

from __future__ import annotations

from functools import lru_cache

from openrecipes.config.hardware import is_cpu
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


def peak_bound(gpu_type: str) -> float | None:
    """The most FLOP/s the hardware table allows one device of ``gpu_type``: a GPU's peak, or the CPU bound."""
    return _hardware().cpu_peak_bf16_dense_flops if is_cpu(gpu_type) else peak_flops(gpu_type)


def memory_gib(gpu_type: str) -> float | None:
    """Memory one GPU of ``gpu_type`` reports (the table's memory_gib), when the table knows it."""
    spec = _hardware().gpus.get(gpu_type.strip().upper())
    return spec.memory_gib if spec else None


def memory_gb(gpu_type: str) -> float | None:
    """Memory one GPU of ``gpu_type`` is sold with (the table's memory_gb), when the table knows it."""
    spec = _hardware().gpus.get(gpu_type.strip().upper())
    return spec.memory_gb if spec else None


def price_for_instance(instance: str | None) -> float | None:
    if instance is None:
        return None
    spec = _hardware().instances.get(instance.strip())
    return spec.usd_per_gpu_hour if spec else None


def _registered_config(model: str, overrides: dict[str, int] | None = None):
    """The config of a registered model as a card names it (``resolve_model_config``), None for one the registry
    does not know."""
    from openrecipes.models.registry import names
    from openrecipes.models.resolve import resolve_model_config

    name = model.strip().lower().replace(" ", "-")
    name = _MODEL_ALIASES.get(name, name)
    return resolve_model_config(name, overrides=overrides) if name in names() else None


def model_active_params(model: str) -> int | None:
    """N of a registered model as a card names it (``card new`` appends ``with key=value, ...`` for the recipe's
    model_overrides); None when the registry does not know the model or an override is not a whole number of a
    field the config holds."""
    base, _, overrides = model.partition(" with ")
    changes: dict[str, int] = {}
    for pair in filter(None, (part.strip() for part in overrides.split(","))):
        key, _, value = pair.partition("=")
        if not value.strip().lstrip("-").isdigit():
            return None
        changes[key.strip()] = int(value)
    try:
        config = _registered_config(base, changes)
    except ValueError:  # a field the config does not hold, or one that is not a whole number
        return None
    return config.active_params() if config is not None else None


def model_layers(model: str) -> int | None:
    config = _registered_config(model)
    return config.num_hidden_layers if config else None


def model_layout(model: str) -> LayoutModel:
    """The sizes the layout rules check of a registered model; none for a model the registry does not know."""
    from openrecipes.models.families import family_for_config

    config = _registered_config(model)
    return family_for_config(config).planner_shape(config, model).layout_model() if config else LayoutModel()
