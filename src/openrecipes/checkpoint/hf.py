"""Hugging Face checkpoints <-> native models and native state dicts."""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from openrecipes.checkpoint.safetensors_io import HFCheckpoint, write_hf_dir
from openrecipes.models.families import ModelFamily, family_for_config, family_for_model_type


def read_config(checkpoint: HFCheckpoint) -> tuple[ModelFamily, Any]:
    source = str(checkpoint.path / "config.json")
    family = family_for_model_type(checkpoint.config.get("model_type"), source=source)
    return family, family.config_from_hf(checkpoint.config, source)


# safetensors dtype codes a weight may have; integers, bools and fp8 would be cast or misread silently
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")


def _expected_shapes(family: ModelFamily, config: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    with torch.device("meta"):
        model = family.build(config, device="meta", seed=None)
    return {name: (param.shape, param.dtype) for name, param in model.named_parameters()}


def iter_native_tensors(checkpoint: HFCheckpoint, family: ModelFamily, config: Any,
                        skipped: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (native name, tensor) for every native parameter, stacking per-expert HF tensors.

    Unknown, missing, duplicated, misshapen or non-float (int, bool, fp8) tensors raise ValueError naming the tensor
    and its file.
    Tensors the family ignores (``family.ignored_key``, e.g. a vision tower in text-only mode) are skipped: their
    names are appended to ``skipped`` when given, and a warning states how many there were.
    """
    expected = _expected_shapes(family, config)
    pieces: dict[str, dict[int | None, str]] = defaultdict(dict)
    ignored: list[str] = []
    for hf_key in checkpoint.keys():
        if family.ignored_key is not None and family.ignored_key(hf_key):
            ignored.append(hf_key)
            continue
        name, expert = family.native_key(hf_key)
        if name not in expected:
            raise ValueError(f"unknown tensor {hf_key!r} in {checkpoint.path / checkpoint.file_of[hf_key]}")
        _, stored = checkpoint.metadata(hf_key)
        if stored not in WEIGHT_DTYPES:
            raise ValueError(f"tensor {hf_key!r} in {checkpoint.path / checkpoint.file_of[hf_key]}: dtype {stored} "
                             f"is not a weight dtype ({', '.join(WEIGHT_DTYPES)}); convert it first")
        pieces[name][expert] = hf_key
    if ignored:
        if skipped is not None:
            skipped.extend(ignored)
        warnings.warn(f"{checkpoint.path}: skipped {len(ignored)} tensor(s) outside the text model "
                      f"(e.g. {ignored[0]!r})", stacklevel=2)
    missing = [name for name in expected if name not in pieces]
    if missing:
        raise ValueError(f"{checkpoint.path}: missing tensor(s) for {missing[:5]}"
                         f"{' and more' if len(missing) > 5 else ''}")
    for name, (shape, _) in expected.items():
        by_expert = pieces[name]
        if None in by_expert:
            tensor = checkpoint.get(by_expert[None])
        else:
            count = shape[0]
            absent = [e for e in range(count) if e not in by_expert]
            if absent or len(by_expert) != count:
                raise ValueError(f"{checkpoint.path}: {name} needs experts 0..{count - 1}; missing {absent[:5]}, "
                                 f"found {len(by_expert)}")
            tensor = torch.stack([checkpoint.get(by_expert[e]) for e in range(count)])
        if tuple(tensor.shape) != tuple(shape):
            first_key = by_expert.get(None) or by_expert[0]
            raise ValueError(f"tensor {first_key!r} in {checkpoint.path / checkpoint.file_of[first_key]}: "
                             f"shape {tuple(tensor.shape)} does not match the config's {tuple(shape)} (for {name})")
        yield name, tensor


def from_hf(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """Load an HF checkpoint directory into the native model (built on meta, then filled)."""
    checkpoint = HFCheckpoint(path)
    family, config = read_config(checkpoint)
    model = family.build(config, device=device, seed=None)
    params = dict(model.named_parameters())
    for name, tensor in iter_native_tensors(checkpoint, family, config):
        target_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        param = params[name]
        param.data = torch.empty(param.shape, dtype=target_dtype, device=device)
        param.data.copy_(tensor)
    return model


def hf_tensors_from_native(state: dict[str, torch.Tensor], family: ModelFamily,
                           config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in state.items():
        yield from family.to_hf(name, tensor.detach().cpu(), config)


def save_hf(model: nn.Module, path: str | Path, *, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> None:
    """Write a native model as an HF checkpoint directory (per-expert tensors, HF config.json)."""
    config = model.config
    family = family_for_config(config)
    state = {name: param for name, param in model.named_parameters()}
    write_hf_dir(path, hf_tensors_from_native(state, family, config), family.config_to_hf(config),
                 max_shard_bytes=max_shard_bytes, overwrite=overwrite)
