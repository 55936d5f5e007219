"""The model config a run names, worked out in one place: a registry name or a Hugging Face checkpoint directory
(its config.json), with the run's ``model_overrides`` applied and checked field by field. Train, the export of a
training checkpoint, the tuner and the card checks all ask this module; it takes plain values, not a recipe."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Mapping

from openrecipes.models.families import ModelFamily, family_for_model_type
from openrecipes.utils import read_json

HF_CONFIG_FILE = "config.json"


def read_hf_config(directory: str | Path) -> dict:
    """The fields of a checkpoint directory's config.json; a missing directory or file, or a file that is not a JSON
    object, is an error naming the path."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    path = directory / HF_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    fields = read_json(path)
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: expected a JSON object of config fields, got a {type(fields).__name__}")
    return fields


def config_from_hf_fields(fields: Mapping[str, Any], source: str, *, full: bool = False) -> tuple[ModelFamily, Any]:
    """The family and model config of a checkpoint's config.json fields (``source`` names the file in errors).
    ``full=False`` (text-only mode, the default): for a family with that mode (``ModelFamily.text_only``: Muse Spark),
    the config of the text model alone, without the perception towers; ``full=True``: the whole checkpoint's config,
    towers included."""
    family = family_for_model_type(fields.get("model_type"), source=source)
    config = family.config_from_hf(dict(fields), source)
    if not full and family.text_only is not None:
        config = family.text_only(config)
    return family, config


def resolve_model_config(model: str, *, overrides: Mapping[str, Any] | None = None, full: bool = False,
                         from_checkpoint: bool = False) -> Any:
    """The config of ``model`` (a registry name or a checkpoint directory) with ``overrides`` applied. ``full``: a
    directory is read in full-checkpoint mode (towers kept: the run trains on image rows); ``from_checkpoint``: the
    run loads the directory's weights (``init: checkpoint``), which a registry name has none of."""
    from openrecipes.models.registry import get_config, names

    if model in names():
        if from_checkpoint:
            raise ValueError(f"init: 'checkpoint' needs model to be a Hugging Face directory, got {model!r}")
        config = get_config(model)
    elif Path(model).is_dir():
        _, config = config_from_hf_fields(read_hf_config(model), str(Path(model) / HF_CONFIG_FILE), full=full)
    else:
        raise ValueError(f"model: {model!r} is neither a registered model ({', '.join(names())}) "
                         "nor a checkpoint directory")
    return with_overrides(config, overrides or {})


# a layer count no config may declare without the tensors to show for it: building such a config alone takes
# minutes (published models have under 200 layers)
MAX_DECLARED_LAYERS = 10_000


def with_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """``config`` with ``overrides`` (``model_overrides``) replacing its fields; an unknown field, or a value of
    another type than the one it replaces, is an error naming the field."""
    if not overrides:
        return config
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"model_overrides: unknown config field(s) {unknown}")
    hints = typing.get_type_hints(type(config))
    values = {}
    for key, value in overrides.items():
        _check_override(key, value, getattr(config, key))
        if not _fits(value, hints.get(key, Any)):
            raise ValueError(f"model_overrides.{key}: expected {_spoken(hints[key])}, got {value!r}")
        # YAML has lists only: a tuple field keeps its kind
        values[key] = tuple(value) if isinstance(value, list) and tuple in _kinds(hints.get(key)) else value
        if _out_of_range(key, value):
            least = "above 0" if key in _POSITIVE_FIELDS else "of at least 0"
            raise ValueError(f"model_overrides.{key}: expected a number {least}, got {value!r}")
    layers = values.get("num_hidden_layers")
    if isinstance(layers, int) and not 0 < layers <= MAX_DECLARED_LAYERS:
        raise ValueError(f"model_overrides.num_hidden_layers: expected 1 to {MAX_DECLARED_LAYERS:,}, got {layers}")
    return dataclasses.replace(config, **values)


# fields no model computes at 0 (a division or a log of them)
_POSITIVE_FIELDS = ("rope_theta", "rms_norm_eps", "initializer_range", "max_position_embeddings")


def _out_of_range(key: str, value: Any) -> bool:
    """A size, id, rate or scale below 0 (or at 0 where the model divides by it): no config a model trains with."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value < 0 or (value == 0 and key in _POSITIVE_FIELDS)


def _kinds(hint: Any) -> set[Any]:
    """The containers ``hint`` (or any member of its union) names."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in typing.get_args(hint)))
    return {typing.get_origin(hint)}


def _fits(value: Any, hint: Any) -> bool:
    """``value`` (plain data from YAML) is of the annotated type: scalars, None, unions, lists and tuples of them,
    literals; any other annotation (a nested config, a mapping) is left to the config's own checks."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint in (bool, int, float, str):
        return (isinstance(value, bool) == (hint is bool)
                and isinstance(value, (int, float) if hint is float else hint))
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple):
        item = args[0] if args else Any
        return isinstance(value, (list, tuple)) and all(_fits(element, item) for element in value)
    return True


def _spoken(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "None")


_OVERRIDE_TYPES = ((bool, (bool,), "true or false"), (int, (int,), "an integer"), (float, (int, float), "a number"),
                   (str, (str,), "a string"))


def _check_override(key: str, value: Any, default: Any) -> None:
    """An override must have the type of the value it replaces (an int for a size, a float for a rate, ...)."""
    for kind, accepted, name in _OVERRIDE_TYPES:
        if isinstance(default, kind):
            # a bool is an int to Python, never to a config
            if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
                raise ValueError(f"model_overrides.{key}: expected {name} (like {default!r}), got {value!r}")
            return
