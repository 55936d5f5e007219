"""Hugging Face checkpoints <-> native models and native state dicts."""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from openrecipes.checkpoint.safetensors_io import HFCheckpoint, write_hf_dir
from openrecipes.models.common.precision import fp32_parameter_names
from openrecipes.models.families import ModelFamily, family_for_config, family_for_model_type


def read_config(checkpoint: HFCheckpoint) -> tuple[ModelFamily, Any]:
    source = str(checkpoint.path / "config.json")
    family = family_for_model_type(checkpoint.config.get("model_type"), source=source)
    return family, family.config_from_hf(checkpoint.config, source)


def _expected_parameters(family: ModelFamily, config: Any) -> tuple[dict[str, torch.Size], set[str]]:
    """Each native parameter's shape, and the names the model pins to fp32 (built on the meta device)."""
    model = family.build(config, device="meta", seed=None)
    return ({name: param.shape for name, param in model.named_parameters()}, set(fp32_parameter_names(model)))


def iter_native_tensors(checkpoint: HFCheckpoint, family: ModelFamily, config: Any,
                        skipped: list[str] | None = None,
                        promoted: dict[str, torch.dtype] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (native name, tensor) for every native parameter, stacking per-expert HF tensors.

    Unknown, missing, duplicated or misshapen tensors raise ValueError naming the tensor and its file.
    Tensors the family ignores (``family.ignored_key``, e.g. a vision tower in text-only mode) are skipped: their
    names are appended to ``skipped`` when given, and a warning states how many there were.
    Parameters the model pins to fp32 (``KeepFP32``: router, expert bias, residual gates) that the file stores in a
    narrower float (the published checkpoint keeps its residual gates in bf16) are promoted to fp32, which leaves
    every value unchanged; ``promoted`` (when given) receives their names and source dtypes. Every other tensor keeps
    its dtype.
    """
    expected, pinned = _expected_parameters(family, config)
    pieces: dict[str, dict[int | None, str]] = defaultdict(dict)
    ignored: list[str] = []
    for hf_key in checkpoint.keys():
        if family.ignored_key is not None and family.ignored_key(hf_key):
            ignored.append(hf_key)
            continue
        name, expert = family.native_key(hf_key)
        if name not in expected:
            raise ValueError(f"unknown tensor {hf_key!r} in {checkpoint.path / checkpoint.file_of[hf_key]}")
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
    for name, shape in expected.items():
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
        if name in pinned and tensor.is_floating_point() and torch.finfo(tensor.dtype).bits < 32:
            if promoted is not None:
                promoted[name] = tensor.dtype
            tensor = tensor.float()  # exact: every bf16 and fp16 value is an fp32 value
        yield name, tensor


def from_hf(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """Load an HF checkpoint directory into the native model.

    ``dtype=None`` keeps each tensor's dtype from the file (fp32-pinned tensors stored narrower are promoted to fp32,
    see ``iter_native_tensors``). With a ``dtype`` the model decides each parameter's
    dtype: it is built on the meta device and cast with ``.to(dtype)``, where ``KeepFP32`` modules keep the router
    weight, the expert bias and the residual gates in fp32 (never rounded); every tensor is then read straight into
    that dtype, so no full-precision copy of the whole model is ever held.
    """
    checkpoint = HFCheckpoint(path)
    family, config = read_config(checkpoint)
    model = family.build(config, device="meta", dtype=dtype or torch.float32, seed=None)
    for name, tensor in iter_native_tensors(checkpoint, family, config):
        module_name, _, param_name = name.rpartition(".")
        owner = model.get_submodule(module_name)
        old = owner._parameters[param_name]
        target = old.dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        # a new Parameter (a meta tensor's .data cannot be replaced by a real one); requires_grad is the module's
        owner._parameters[param_name] = nn.Parameter(tensor.to(device=device, dtype=target),
                                                     requires_grad=old.requires_grad)
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
