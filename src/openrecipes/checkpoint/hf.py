"""Hugging Face checkpoints <-> native models and native state dicts."""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from openrecipes.checkpoint.safetensors_io import HFCheckpoint, write_hf_dir
from openrecipes.models.common.hf_experts import FusedHalf, Mxfp4Part, Part, Rearranged
from openrecipes.models.common.mxfp4 import dequantize_mxfp4
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.precision import fp32_parameter_names
from openrecipes.models.families import ModelFamily, family_for_config
from openrecipes.models.resolve import (HF_CONFIG_FILE, MAX_DECLARED_LAYERS, config_from_hf_fields,
                                        resolve_model_config)
from openrecipes.utils import one_line


def read_config(checkpoint: HFCheckpoint, *, full: bool = False) -> tuple[ModelFamily, Any]:
    """The family and model config of a checkpoint (``models/resolve.py`` ``config_from_hf_fields``: ``full=False``
    reads a family with a text-only mode as its text model alone, ``full=True`` the whole checkpoint)."""
    # the raw count first: building a config of 10**12 layers loops over every one of them (minutes, or forever)
    _check_layer_count(checkpoint, declared_layers(checkpoint.config))
    family, config = config_from_hf_fields(checkpoint.config, str(checkpoint.path / HF_CONFIG_FILE), full=full)
    _check_layer_count(checkpoint, getattr(config, "num_hidden_layers", None))
    if family.mtp is not None and family.mtp.held(config) and not holds_mtp_tensors(checkpoint, family, config):
        # transformers declares one MTP layer by default and never saves it: such a checkpoint holds none
        warnings.warn(f"{checkpoint.path / HF_CONFIG_FILE}: declares {family.mtp.held(config)} multi-token-prediction "
                      "layer(s) (num_nextn_predict_layers) but holds none of their tensors: read without them",
                      stacklevel=2)
        config = family.mtp.keep(config, False)
    return family, config


def holds_mtp_tensors(checkpoint: HFCheckpoint, family: ModelFamily, config: Any) -> bool:
    """Whether the checkpoint holds any tensor of the multi-token-prediction layers ``config`` declares."""
    without = family.mtp.keep(config, False)  # then the family's ignored_key names exactly those tensors
    return any(family.ignored_key(key, without) for key in checkpoint.keys())


def recipe_model_config(recipe: Any) -> Any:
    """The model config a recipe (``config/recipe.py``) names, a registry name or an HF directory, with its
    ``model_overrides`` applied (``models/resolve.py`` ``resolve_model_config``): what ``train`` builds and what a
    training checkpoint's export describes. The recipe's rows decide how a directory is read
    (``recipe_trains_images``)."""
    config = resolve_model_config(recipe.model, overrides=recipe.model_overrides, full=recipe_trains_images(recipe),
                                  from_checkpoint=recipe.init == "checkpoint")
    return with_mtp(config, recipe.mtp is not None)


def with_mtp(config: Any, keep: bool) -> Any:
    """``config`` holding the multi-token-prediction layers it declares (``keep``: a run that trains them, recipe
    ``mtp``) or leaving them out (import then skips their tensors, with a note); unchanged for a family without any
    (``ModelFamily.mtp``)."""
    declared = family_for_config(config).mtp
    return config if declared is None else declared.keep(config, keep)


def recipe_trains_images(recipe: Any) -> bool:
    """Whether the recipe's rows hold images (``data.build.image_processor``, or a built rows directory whose manifest
    has an ``images`` section). A checkpoint directory is then read in full-checkpoint mode: a family with a text-only
    mode (Muse Spark) keeps its towers, so image-text training starts from the complete checkpoint; text rows read
    the text model alone, as before."""
    if recipe.data.build is not None:
        return recipe.data.build.image_processor is not None
    from openrecipes.data.manifest import MANIFEST_FILE, read_manifest

    rows = Path(recipe.data.rows)
    return (rows / MANIFEST_FILE).is_file() and bool(read_manifest(rows).get("images"))


# safetensors dtype codes a weight may have; integers, bools and fp8 would be cast or misread silently
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")


def _expected_parameters(checkpoint: HFCheckpoint, family: ModelFamily,
                         config: Any) -> tuple[dict[str, torch.Size], set[str]]:
    """Each native parameter's shape, and the names the model pins to fp32 (built on the meta device)."""
    model = build_on_meta(checkpoint.path / HF_CONFIG_FILE, family, config)
    return ({name: param.shape for name, param in model.named_parameters()}, set(fp32_parameter_names(model)))


def build_on_meta(source: str | Path, family: ModelFamily, config: Any, **options: Any) -> nn.Module:
    """The model ``config`` describes, on the meta device. Sizes no tensor can have (a hidden_size of 2**63, or two
    sizes whose product overflows) make torch raise a RuntimeError or TypeError several lines long; here they are
    one line naming ``source`` (the config.json)."""
    try:
        return family.build(config, device="meta", seed=None, **options)
    except (RuntimeError, TypeError, OverflowError) as error:
        first = (str(error).splitlines() or [""])[0]
        raise ValueError(f"{source}: the model it describes cannot be built "
                         f"({type(error).__name__}: {one_line(first)[:200]})") from None


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def declared_layers(fields: dict) -> Any:
    """config.json's decoder layer count as written (top-level, or in a nested ``text_config``, which wins)."""
    text = fields.get("text_config")
    return text["num_hidden_layers"] if isinstance(text, dict) and "num_hidden_layers" in text \
        else fields.get("num_hidden_layers")


def _check_layer_count(checkpoint: HFCheckpoint, layers: Any) -> None:
    """A config claiming more decoder layers than any tensor of the checkpoint holds is refused from the tensor
    names alone, before the model is built on the meta device (ten million layers would take minutes to build)."""
    indices = [int(m.group(1)) for key in checkpoint.keys() if (m := _LAYER_INDEX.search(key))]
    if isinstance(layers, int) and indices and layers > max(indices) + 1:
        raise ValueError(f"{checkpoint.path / 'config.json'}: num_hidden_layers={layers}, but the checkpoint's "
                         f"tensors hold layers 0 to {max(indices)} only")
    if isinstance(layers, int) and layers > MAX_DECLARED_LAYERS and not indices:  # else its tensors are named missing
        raise ValueError(f"{checkpoint.path / 'config.json'}: num_hidden_layers={layers}, more than "
                         f"{MAX_DECLARED_LAYERS:,}, and the checkpoint holds no decoder layer tensors")


def iter_native_tensors(checkpoint: HFCheckpoint, family: ModelFamily, config: Any,
                        skipped: list[str] | None = None, promoted: dict[str, torch.dtype] | None = None,
                        expert_layouts: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (native name, tensor) for every native parameter, assembling experts from either HF layout
    (``common/hf_experts.py``: one tensor per expert, stacked; or fused, a ``gate_up_proj`` split in two halves).

    Unknown, missing, duplicated, misshapen or non-float (int, bool, fp8) tensors raise ValueError naming the tensor
    and its file.
    Tensors the family ignores for this config (``family.ignored_key``: the towers in text-only mode) are skipped:
    their names are appended to ``skipped`` when given, and a warning states how many there were. A config with
    towers (full-checkpoint mode) skips nothing.
    Parameters the model pins to fp32 (``KeepFP32``: router, expert bias, residual gates) that the file stores in a
    narrower float (the published checkpoint keeps its residual gates in bf16) are promoted to fp32, which leaves
    every value unchanged; ``promoted`` (when given) receives their names and source dtypes. Every other tensor keeps
    its dtype. ``expert_layouts`` (when given) receives the expert layouts met ("fused", "per_expert").
    """
    expected, pinned = _expected_parameters(checkpoint, family, config)
    parts: dict[str, dict[Part, str]] = defaultdict(dict)
    ignored: dict[str, list[str]] = defaultdict(list)  # the family's phrase for them -> names
    copies: list[tuple[str, str]] = []  # (HF name, the HF name already filling the same native part)
    for hf_key in checkpoint.keys():
        reason = family.ignored_key(hf_key, config) if family.ignored_key is not None else False
        if reason:
            ignored[reason if isinstance(reason, str) else "outside the text model"].append(hf_key)
            continue
        _, stored = checkpoint.metadata(hf_key)
        quantized = all(isinstance(part, Mxfp4Part) for _, part in family.native_parts(hf_key))
        if stored not in WEIGHT_DTYPES and not (quantized and stored == "U8"):  # MXFP4: uint8, dequantized below
            raise ValueError(f"tensor {hf_key!r} in {checkpoint.path / checkpoint.file_of[hf_key]}: dtype {stored} "
                             f"is not a weight dtype ({', '.join(WEIGHT_DTYPES)}); convert it first")
        mtp_parts = family.mtp.native_parts(hf_key, config) if family.mtp is not None else None
        for name, part in family.native_parts(hf_key) if mtp_parts is None else mtp_parts:
            if name not in expected:
                raise ValueError(f"unknown tensor {hf_key!r} in {checkpoint.path / checkpoint.file_of[hf_key]}")
            first = parts[name].setdefault(part, hf_key)
            if first != hf_key:
                copies.append((hf_key, first))
    for phrase, names in ignored.items():
        if skipped is not None:
            skipped.extend(names)
        warnings.warn(f"{checkpoint.path}: skipped {len(names)} tensor(s) {phrase} (e.g. {names[0]!r})", stacklevel=2)
    for copy, original in copies:
        _check_copy(checkpoint, copy, original)
    missing = [name for name in expected if name not in parts]
    if missing:
        raise ValueError(f"{checkpoint.path}: missing tensor(s) for {missing[:5]}"
                         f"{' and more' if len(missing) > 5 else ''}")
    for name, shape in expected.items():
        tensor = _assemble(checkpoint, name, tuple(shape), parts[name], expert_layouts)
        if name in pinned and tensor.is_floating_point() and torch.finfo(tensor.dtype).bits < 32:
            if promoted is not None:
                promoted[name] = tensor.dtype
            tensor = tensor.float()  # exact: every bf16 and fp16 value is an fp32 value
        yield name, tensor


def _check_copy(checkpoint: HFCheckpoint, copy: str, original: str) -> None:
    """Two HF tensors filling one native parameter (a checkpoint storing a shared tensor twice: DeepSeek-V3's MTP
    layer's embedding and head) must be bitwise equal, or import would drop one's values without a word."""
    a, b = checkpoint.get(copy), checkpoint.get(original)
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        raise ValueError(f"tensor {copy!r} in {checkpoint.path / checkpoint.file_of[copy]} differs from {original!r} "
                         "(the model shares one tensor for both, so they must be equal)")


def _assemble(checkpoint: HFCheckpoint, name: str, shape: tuple[int, ...], parts: dict[Part, str],
              expert_layouts: set[str] | None) -> torch.Tensor:
    """One native parameter from the HF tensor(s) that hold it (see ``common/hf_experts.Part``)."""
    kinds = {type(part) for part in parts}
    if len(kinds) > 1:
        raise ValueError(f"{checkpoint.path}: {name} is stored in more than one layout "
                         f"({', '.join(sorted(set(parts.values()))[:3])}); keep one")
    key = next(iter(parts.values()))
    if None in parts:
        tensor = checkpoint.get(key)
    elif kinds == {FusedHalf}:  # one half (gate or up) of dim 1 of a fused gate_up_proj
        (half,) = parts
        fused_shape = (shape[0], 2 * shape[1], *shape[2:])
        if checkpoint.metadata(key)[0] != fused_shape:
            raise ValueError(f"tensor {key!r} in {checkpoint.path / checkpoint.file_of[key]}: shape "
                             f"{checkpoint.metadata(key)[0]} does not match the config's {fused_shape} (fused gate "
                             f"and up projections, for {name})")
        tensor = checkpoint.get_slice(key, slice(None), slice(half.index * shape[1], (half.index + 1) * shape[1]))
        if expert_layouts is not None:
            expert_layouts.add("fused")
    elif kinds == {Rearranged}:  # a fixed view of one whole tensor (gpt-oss's transposed, interleaved experts)
        (part,) = parts
        if checkpoint.metadata(key)[0] != part.hf_shape(shape):
            raise ValueError(f"tensor {key!r} in {checkpoint.path / checkpoint.file_of[key]}: shape "
                             f"{checkpoint.metadata(key)[0]} does not match the config's {part.hf_shape(shape)} "
                             f"(for {name})")
        tensor = part.take(checkpoint.get(key))
    elif kinds == {Mxfp4Part}:  # MXFP4 blocks and scales, dequantized (common/mxfp4.py), then this half's rows
        tensor = _dequantized(checkpoint, name, parts)
    else:  # one tensor per expert, stacked along dim 0
        absent = [e for e in range(shape[0]) if e not in parts]
        if absent or len(parts) != shape[0]:
            raise ValueError(f"{checkpoint.path}: {name} needs experts 0..{shape[0] - 1}; missing {absent[:5]}, "
                             f"found {len(parts)}")
        key = parts[0]
        tensor = torch.stack([checkpoint.get(parts[e]) for e in range(shape[0])])
        if expert_layouts is not None:
            expert_layouts.add("per_expert")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"tensor {key!r} in {checkpoint.path / checkpoint.file_of[key]}: "
                         f"shape {tuple(tensor.shape)} does not match the config's {shape} (for {name})")
    return tensor


def _dequantized(checkpoint: HFCheckpoint, name: str, parts: dict[Part, str]) -> torch.Tensor:
    roles = {part.role: key for part, key in parts.items()}
    if set(roles) != {"blocks", "scales"}:
        raise ValueError(f"{checkpoint.path}: {name} needs MXFP4 blocks and scales; found only {sorted(roles)}")
    half = next(iter(parts)).half
    weight = dequantize_mxfp4(checkpoint.get(roles["blocks"]), checkpoint.get(roles["scales"]),
                              dtype=torch.bfloat16)
    return weight if half is None else weight[..., half::2, :].contiguous()


def from_hf(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
            kernels: KernelOptions | None = None, full: bool = False, keep_mtp: bool = True) -> nn.Module:
    """Load an HF checkpoint directory into the native model (``full``: with the perception towers, see
    ``read_config``; by default a Muse Spark checkpoint loads its text model alone). ``keep_mtp=False`` leaves out
    the multi-token-prediction layers a checkpoint declares (``with_mtp``: a run that does not train them).

    ``dtype=None`` keeps each tensor's dtype from the file (fp32-pinned tensors stored narrower are promoted to fp32,
    see ``iter_native_tensors``). With a ``dtype`` the model decides each parameter's
    dtype: it is built on the meta device and cast with ``.to(dtype)``, where ``KeepFP32`` modules keep the router
    weight, the expert bias and the residual gates in fp32 (never rounded); every tensor is then read straight into
    that dtype, so no full-precision copy of the whole model is ever held.
    """
    checkpoint = HFCheckpoint(path)
    family, config = read_config(checkpoint, full=full)
    config = config if keep_mtp else with_mtp(config, False)
    model = build_on_meta(checkpoint.path / HF_CONFIG_FILE, family, config, dtype=dtype or torch.float32,
                          kernels=kernels or KernelOptions())
    for name, tensor in iter_native_tensors(checkpoint, family, config):
        module_name, _, param_name = name.rpartition(".")
        owner = model.get_submodule(module_name)
        old = owner._parameters[param_name]
        target = old.dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        # a new Parameter (a meta tensor's .data cannot be replaced by a real one); requires_grad is the module's
        owner._parameters[param_name] = nn.Parameter(tensor.to(device=device, dtype=target),
                                                     requires_grad=old.requires_grad)
    return model


def hf_tensors_from_native(state: dict[str, torch.Tensor], family: ModelFamily, config: Any,
                           expert_layout: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors for a native state dict; experts in ``expert_layout`` (None: the family's default)."""
    return family.to_hf(((name, tensor.detach().cpu()) for name, tensor in state.items()), config, expert_layout)


def save_hf(model: nn.Module, path: str | Path, *, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
            expert_layout: str | None = None, inputs: Iterable[str | Path] = ()) -> None:
    """Write a native model as an HF checkpoint directory (HF config.json; experts in ``expert_layout``, by default
    the family's: fused for Muse Spark, one tensor per expert for Qwen3-MoE); ``path`` keeps apart from ``inputs``
    (what the model was made from)."""
    config = model.config
    family = family_for_config(config)
    state = {name: param for name, param in model.named_parameters()}
    write_hf_dir(path, hf_tensors_from_native(state, family, config, expert_layout), family.config_to_hf(config),
                 max_shard_bytes=max_shard_bytes, overwrite=overwrite, inputs=inputs)
