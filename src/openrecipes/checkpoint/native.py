"""Native checkpoints: a torch.distributed.checkpoint (DCP) directory of native-named tensors plus config.json.

Layout of CKPT_DIR:
  config.json        the model's Hugging Face config (to rebuild the model)
  openrecipes.json   what wrote it, the tensors it holds (names, shapes, dtypes, source dtypes), the tensors
                     promoted to fp32 on import and the source's expert layout
  __0_0.distcp, .metadata   the DCP files

DCP reshards on load, so a directory written under one parallel layout loads under another.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from openrecipes.checkpoint.safe_load import load_dcp
from openrecipes.checkpoint.hf import hf_tensors_from_native, iter_native_tensors, read_config
from openrecipes.checkpoint.safetensors_io import HFCheckpoint, write_hf_dir
from openrecipes.checkpoint.checksums import verify_checksums, write_checksums
from openrecipes.utils import atomic_write_text, check_output_dir, guarded_output_dir, one_line, read_json
from openrecipes.version import __version__

MANIFEST = "openrecipes.json"
# marks a directory as written by `convert import`, so --overwrite may replace it (and nothing else)
NATIVE_MARKER = ".openrecipes-native"


def import_hf(hf_dir: str | Path, ckpt_dir: str | Path, *, overwrite: bool = False,
              full: bool = False) -> dict[str, Any]:
    """HF safetensors directory -> native DCP directory. Dtypes are kept tensor by tensor, except that tensors the
    model pins to fp32 and the file stores narrower are promoted to fp32 (values unchanged). The manifest records
    each tensor's ``source_dtype`` and the source's ``expert_layout`` so that export can write them again.
    ``full``: every tensor of the checkpoint, perception towers included; by default (text-only mode) a Muse Spark
    checkpoint's towers are skipped and counted (``checkpoint.hf.read_config``). The manifest's ``mode`` and
    ``skipped`` record which."""
    guard = dict(marker=NATIVE_MARKER, writer="openrecipes convert import", overwrite=overwrite, inputs=[hf_dir],
                 option="CKPT_DIR")
    check_output_dir(ckpt_dir, **guard)  # before reading every tensor: a refusal costs nothing
    checkpoint = HFCheckpoint(hf_dir)
    family, config = read_config(checkpoint, full=full)
    promoted: dict[str, torch.dtype] = {}
    layouts: set[str] = set()
    skipped: list[str] = []
    # every tensor read is checked finite (HFCheckpoint): a NaN imported would be trained from and exported
    state = dict(iter_native_tensors(checkpoint, family, config, skipped, promoted=promoted, expert_layouts=layouts))
    manifest = {
        "format": "openrecipes-native-v1", "writer": f"openrecipes {__version__}", "source": str(hf_dir),
        "tensors": {name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
                           "source_dtype": _dtype_name(promoted.get(name, t.dtype))}
                    for name, t in state.items()},
        "promoted": sorted(promoted),
        "mode": "full" if full else "text-only",
        "skipped": len(skipped),  # source tensors not imported (the towers, in text-only mode)
        # the source's expert layout, which export writes again by default (None: none, or both, were met)
        "expert_layout": layouts.pop() if len(layouts) == 1 else None,
    }
    with guarded_output_dir(ckpt_dir, **guard) as staging:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)), no_dist=True)
        atomic_write_text(staging / "config.json", json.dumps(checkpoint.config, indent=2) + "\n")
        atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        # after every other file, the manifest included: what it claims (dtypes, shapes) is checked like the weights
        write_checksums(staging, no_dist=True)
    return manifest


def load_native_state(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read every tensor of a native checkpoint into CPU memory, with its HF config."""
    ckpt_dir = Path(ckpt_dir)
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} is missing: {ckpt_dir} is not a complete native checkpoint "
                                "(`convert import` output) nor a training save (RUN_DIR/checkpoints/step-NNNNNN)")
    # empty tensors only (nothing is read into them before load_dcp has checked every file, this manifest included);
    # the manifest is not checked yet, so its shapes are bounded by the bytes the directory holds before allocating
    held = sum(p.stat().st_size for p in ckpt_dir.iterdir() if p.is_file())
    try:
        state = _empty_state(read_json(manifest_path), manifest_path, held)
    except _LargerThanFiles:  # a deleted or truncated shard leaves the files short too: the checksums name it
        verify_checksums(ckpt_dir, no_dist=True, required=True, unlisted=(NATIVE_MARKER,))
        raise
    # checksums required and checked (the overwrite marker comes after them); tensors checked finite; restricted:
    # a checkpoint's pickles cannot run code
    load_dcp(state, ckpt_dir, no_dist=True, unlisted=(NATIVE_MARKER,))
    config = read_json(ckpt_dir / "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{ckpt_dir / 'config.json'}: expected a JSON object")
    return state, config


class _LargerThanFiles(ValueError):
    """A manifest shape needing more bytes than the checkpoint's files hold."""


def _weight_dtype(name: str, info: dict, key: str) -> torch.dtype:
    """The floating-point dtype the manifest names under ``key`` for tensor ``name`` (``dtype``, ``source_dtype``)."""
    dtype = getattr(torch, info[key], None) if isinstance(info[key], str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {name!r}: unknown {key} {info[key]!r}")
    if not dtype.is_floating_point:  # every native tensor is a weight: an int or bool one is no import's
        raise ValueError(f"tensor {name!r}: {key} {info[key]!r} is not a floating-point weight dtype")
    return dtype


def _empty_state(manifest: Any, source: Path, held: int) -> dict[str, torch.Tensor]:
    """Empty tensors of the shapes and dtypes the manifest lists (what DCP loads into); a tensor larger than the
    ``held`` bytes of the directory's files is refused before anything is allocated."""
    try:
        state = {}
        for name, info in manifest["tensors"].items():
            dtype = _weight_dtype(name, info, "dtype")
            if "source_dtype" in info:  # what export casts to
                _weight_dtype(name, info, "source_dtype")
            shape = [int(n) for n in info["shape"]]
            if any(n < 0 for n in shape):
                raise ValueError(f"tensor {name!r}: negative size in shape {shape}")
            if math.prod(shape) * dtype.itemsize > held:
                raise _LargerThanFiles(f"tensor {name!r}: shape {shape} needs more bytes than the checkpoint's "
                                       f"files hold ({held})")
            state[name] = torch.empty(shape, dtype=dtype)
        return state
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        kind = _LargerThanFiles if isinstance(error, _LargerThanFiles) else ValueError
        raise kind(f"{source}: not a native checkpoint manifest ({one_line(error)})") from None


EXPORT_DTYPES = ("source", "native")


def export_hf(ckpt_dir: str | Path, hf_dir: str | Path, *, max_shard_bytes: int = 5 * 2**30,
              overwrite: bool = False, dtypes: str = "source", expert_layout: str | None = None) -> None:
    """Native DCP directory -> HF safetensors directory (an index when sharded).

    ``dtypes="source"`` writes each tensor in the dtype its source checkpoint had (the manifest's ``source_dtype``:
    residual gates promoted on import go back to bf16, bitwise equal to the source); ``"native"`` writes the native
    dtypes (the promoted tensors stay fp32). A tensor whose values do not survive the cast back is rounded, with a
    warning naming it. ``expert_layout`` ("fused" or "per_expert", see ``models/common/hf_experts.py``): None writes
    the layout the source had, else the family's default (fused for Muse Spark, per expert for Qwen3-MoE).
    """
    from openrecipes.checkpoint.safetensors_io import HF_MARKER, HF_WRITER
    from openrecipes.models.families import family_for_model_type

    if dtypes not in EXPORT_DTYPES:
        raise ValueError(f"dtypes must be one of {EXPORT_DTYPES}, got {dtypes!r}")
    check_output_dir(hf_dir, marker=HF_MARKER, writer=HF_WRITER, overwrite=overwrite, inputs=[ckpt_dir],
                     option="HF_DIR")  # before loading every tensor: a refusal costs nothing
    state, raw_config = load_native_state(ckpt_dir)
    manifest = json.loads((Path(ckpt_dir) / MANIFEST).read_text())
    if dtypes == "source":
        _cast_to_source_dtypes(state, manifest["tensors"], Path(ckpt_dir))
    source = str(Path(ckpt_dir) / "config.json")
    _check_model_tensors(state, raw_config, source)
    family = family_for_model_type(raw_config.get("model_type"), source=source)
    config = family.config_from_hf(raw_config, source)
    layout = expert_layout or manifest.get("expert_layout")
    write_hf_dir(hf_dir, hf_tensors_from_native(state, family, config, layout), raw_config,
                 max_shard_bytes=max_shard_bytes, overwrite=overwrite, inputs=[ckpt_dir])


def _check_model_tensors(state: dict[str, torch.Tensor], raw_config: dict, source: str) -> None:
    """The tensors are exactly those of the model config.json describes, as an import reads it (text-only or full,
    MTP layers held or not), with its shapes: a tensor taken out of the manifest, checksums recomputed, is named
    here instead of being left out of the export."""
    from openrecipes.checkpoint.hf import build_on_meta, declared_layers
    from openrecipes.models.resolve import MAX_DECLARED_LAYERS, config_from_hf_fields

    layers = declared_layers(raw_config)
    if isinstance(layers, int) and layers > MAX_DECLARED_LAYERS:
        raise ValueError(f"{source}: num_hidden_layers {layers} is more than any checkpoint holds "
                         f"({MAX_DECLARED_LAYERS} at most)")
    readings = []
    for full in (False, True):
        family, config = config_from_hf_fields(raw_config, source, full=full)
        readings += [config] + ([family.mtp.keep(config, False)] if family.mtp and family.mtp.held(config) else [])
    shapes = [{name: param.shape for name, param in build_on_meta(source, family, config).named_parameters()}
              for config in readings]  # the reading nearest to the tensors held: the one its errors are named by
    expected = min(shapes, key=lambda names: len(names.keys() ^ state.keys()))
    missing = [name for name in expected if name not in state]
    unknown = [name for name in state if name not in expected]
    if missing or unknown:
        what = f"missing {missing[:3]}" if missing else f"holds {unknown[:3]}, which the model has not"
        raise ValueError(f"{source}: the checkpoint's tensors are not those of the model this config describes "
                         f"({what}); nothing exported")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {list(state[name].shape)}, the config's model "
                             f"{list(shape)}; nothing exported")


def _cast_to_source_dtypes(state: dict[str, torch.Tensor], tensors: dict[str, dict], ckpt_dir: Path) -> None:
    rounded = []
    for name, info in tensors.items():
        # older manifests: no source dtype; both were checked to be float dtypes (``_empty_state``)
        source_dtype = getattr(torch, info.get("source_dtype", info["dtype"]))
        tensor = state[name]
        if tensor.dtype == source_dtype:
            continue
        state[name] = tensor.to(source_dtype)
        if not torch.equal(state[name].to(tensor.dtype), tensor):
            rounded.append(name)
    if rounded:
        warnings.warn(f"{ckpt_dir}: {len(rounded)} tensor(s) rounded to their source dtype (e.g. {rounded[0]!r}); "
                      "export with dtypes='native' (--dtypes native) to keep them fp32", stacklevel=3)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
