"""Reading a Hugging Face ``config.json``: every key is honoured, known not to change the computation, or refused.

A family's reader takes the keys its config dataclass has (and those it translates itself, such as ``rope_theta``);
``check_other_keys`` then accounts for every remaining key. Keys listed in ``NO_COMPUTATION_KEYS`` are read and set
aside with the reason beside them; keys in a family's ``neutral`` table are accepted only at a value that leaves the
computation unchanged; any other key is refused by name. So a new key that transformers starts writing is an error
until someone decides what it means here, never a silent difference.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Callable

_GENERATION = "a generation default; training and the forward pass do not read it"
_OUTPUT = "selects what a transformers forward returns, not what it computes"
_BOOKKEEPING = "bookkeeping written by transformers"
_HEADS = "labels of classification heads; the causal LM has none"
_ENCODER_DECODER = "encoder-decoder wiring, not read by a decoder-only causal LM"

# Keys transformers' PretrainedConfig.to_dict writes for every model (4.x and 5.x), with why each leaves the
# computation of the causal LM unchanged.
NO_COMPUTATION_KEYS: dict[str, str] = {
    "architectures": _BOOKKEEPING, "model_type": _BOOKKEEPING, "transformers_version": _BOOKKEEPING,
    "_name_or_path": _BOOKKEEPING, "_commit_hash": _BOOKKEEPING, "_attn_implementation_autoset": _BOOKKEEPING,
    "dtype": "the storage dtype of the checkpoint; the loader's dtype argument decides the compute dtype",
    "torch_dtype": "the storage dtype of the checkpoint (4.x spelling of dtype)",
    "use_bfloat16": "a legacy storage hint no model reads",
    "use_cache": "the inference key/value cache; a training forward keeps no cache",
    "output_hidden_states": _OUTPUT, "output_attentions": _OUTPUT, "return_dict": _OUTPUT, "torchscript": _OUTPUT,
    "output_scores": _GENERATION, "return_dict_in_generate": _GENERATION,
    "id2label": _HEADS, "label2id": _HEADS, "num_labels": _HEADS, "problem_type": _HEADS,
    "finetuning_task": _HEADS,
    "bos_token_id": "a token id for data and generation; the model never reads it",
    "eos_token_id": "a token id for data and generation; the model never reads it",
    "sep_token_id": "a token id for data and generation; the model never reads it",
    "decoder_start_token_id": _ENCODER_DECODER,
    "is_encoder_decoder": _ENCODER_DECODER, "is_decoder": _ENCODER_DECODER, "add_cross_attention": _ENCODER_DECODER,
    "cross_attention_hidden_size": _ENCODER_DECODER, "tie_encoder_decoder": _ENCODER_DECODER,
    "chunk_size_feed_forward": "a memory option of other architectures' feed-forward layers; not read here",
    "tf_legacy_loss": "TensorFlow models only",
    "tokenizer_class": "tokenizer metadata", "prefix": "pipeline metadata", "task_specific_params": "pipeline metadata",
    **{key: _GENERATION for key in (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens")},
}


def _zero(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


# key -> (accepts the value?, the value that is accepted): keys every family accepts only where they are neutral
COMMON_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    # transformers drops out attention probabilities in training mode; the native attention has no dropout
    "attention_dropout": (_zero, "0.0 (attention dropout is not implemented)"),
    # 4.x prunes these heads at load (Qwen3-MoE does not implement pruning); the native models keep every head
    "pruned_heads": (_empty, "{} (head pruning is not implemented)"),
}


def check_other_keys(raw: dict[str, Any], *, handled: set[str], family: str, source: str,
                     neutral: dict[str, tuple[Callable[[Any], bool], str]] | None = None) -> None:
    """Raise a ValueError naming the first key of ``raw`` that is neither ``handled`` (honoured by the family's
    reader), nor in ``NO_COMPUTATION_KEYS``, nor at its neutral value (``COMMON_NEUTRAL`` and ``neutral``)."""
    neutral_keys = {**COMMON_NEUTRAL, **(neutral or {})}
    for key, value in raw.items():
        if key in handled or key in NO_COMPUTATION_KEYS:
            continue
        if key in neutral_keys:
            accepts, expected = neutral_keys[key]
            if not accepts(value):
                raise ValueError(f"{source}: {key}={value!r} is not supported for {family}: only {expected}")
            continue
        raise ValueError(f"{source}: unknown {family} config field {key!r}: it is neither implemented nor known "
                         "to leave the computation unchanged")


# transformers 5.x reads the legacy ``rope_scaling`` first: a non-empty one replaces ``rope_parameters`` whole (its
# rope_theta too), and a dict without rope_theta takes the top-level ``rope_theta``, else the config class's default.
ROPE_PLACEMENTS = ("rope_scaling", "rope_parameters")
# the only RoPE the native models compute (common.rope); scaled types (linear, dynamic, yarn, longrope, llama3, ...)
# are refused, never computed as plain RoPE
SUPPORTED_ROPE_TYPES = ("default",)
_ROPE_DICT_KEYS = {"rope_type", "type", "rope_theta"}


def _positive_theta(value: Any, where: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: {where} must be a positive number, got {value!r}")
    return float(value)


def _check_rope_dict(placement: str, rope: Any, *, source: str, extra_keys: frozenset[str],
                     rope_types: tuple[str, ...]) -> None:
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: {placement} must be an object or null, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if "type" in rope and rope_type != rope["type"]:
        raise ValueError(f"{source}: {placement}.type={rope['type']!r} contradicts "
                         f"{placement}.rope_type={rope_type!r}")
    if rope_type not in rope_types:
        raise ValueError(f"{source}: {placement}.rope_type={rope_type!r} is not supported: only "
                         f"{' or '.join(map(repr, rope_types))} (RoPE scaling is not implemented)")
    for key in rope:
        if key not in _ROPE_DICT_KEYS | extra_keys:
            raise ValueError(f"{source}: {placement}.{key}={rope[key]!r} is not supported: RoPE reads only "
                             f"{sorted(_ROPE_DICT_KEYS | extra_keys)}")
    if "rope_theta" in rope:
        _positive_theta(rope["rope_theta"], f"{placement}.rope_theta", source)


def read_rope(raw: dict[str, Any], *, source: str, default_theta: float, extra_keys: frozenset[str] = frozenset(),
              rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[float, dict[str, Any]]:
    """The RoPE base and the RoPE dict transformers computes from ``raw`` (``ROPE_PLACEMENTS``' priority), after
    checking every placement: each dict names a supported type and only known keys (``extra_keys`` are the
    family's own, such as M-RoPE's; ``rope_types`` the types the family computes), and every rope_theta is a positive number; anything else is refused by name."""
    for placement in ROPE_PLACEMENTS:
        if raw.get(placement) is not None:
            _check_rope_dict(placement, raw[placement], source=source, extra_keys=extra_keys, rope_types=rope_types)
    top_theta = _positive_theta(raw["rope_theta"], "rope_theta", source) if "rope_theta" in raw else default_theta
    chosen = next((raw[placement] for placement in ROPE_PLACEMENTS if raw.get(placement)), {})
    return float(chosen.get("rope_theta", top_theta)), dict(chosen)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
               type(None): "null"}


def _matches(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` (parsed JSON) fits the type ``hint``; None where the hint is not one this checks."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        results = [_matches(value, arg) for arg in typing.get_args(hint)]
        return None if all(result is None for result in results) else any(r is not False for r in results)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # JSON writes 1e6 as a float and 10000 as an integer: both are numbers
        # Python's json reads NaN and Infinity: no epsilon, base or scale a model computes with is one of those
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and math.isfinite(value))
    if hint is str:
        return isinstance(value, str)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False
        items = [arg for arg in typing.get_args(hint) if arg is not Ellipsis]
        return all(_matches(item, items[0]) is not False for item in value) if items else True
    return None


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) in (tuple, list):
        items = [arg for arg in typing.get_args(hint) if arg is not Ellipsis]
        return f"a list of {_describe(items[0]).removeprefix('an ').removeprefix('a ')}s" if items else "a list"
    return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def check_field_types(config_class: type, values: dict[str, Any], *, source: str) -> None:
    """Raise a ValueError naming the first of ``values`` whose JSON type does not fit the field of the dataclass
    ``config_class`` it fills ("hidden_size": "64" is refused here, not met later as a TypeError)."""
    hints = typing.get_type_hints(config_class)
    for name, value in values.items():
        hint = hints.get(name)
        if hint is not None and _matches(value, hint) is False:
            raise ValueError(f"{source}: {name}={value!r} must be {_describe(hint)}")


def build_config(config_class: type, kwargs: dict[str, Any], *, source: str) -> Any:
    """``config_class(**kwargs)`` for a config read from ``source``: a required field missing, or a value the class
    refuses, is one error naming ``source``."""
    from dataclasses import MISSING, fields

    missing = [f.name for f in fields(config_class)
               if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {missing}")
    try:
        return config_class(**kwargs)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
