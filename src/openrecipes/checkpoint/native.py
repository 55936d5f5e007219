"""Native checkpoints: a torch.distributed.checkpoint (DCP) directory of native-named tensors plus config.json.

Layout of CKPT_DIR:
  config.json        the model's Hugging Face config (to rebuild the model)
  openrecipes.json   what wrote it, and the tensors it holds (names, shapes, dtypes)
  __0_0.distcp, .metadata   the DCP files

DCP reshards on load, so a directory written under one parallel layout loads under another.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from openrecipes import __version__
from openrecipes.checkpoint.safe_load import load_dcp
from openrecipes.checkpoint.hf import hf_tensors_from_native, iter_native_tensors, read_config
from openrecipes.checkpoint.safetensors_io import HFCheckpoint, write_hf_dir
from openrecipes.checkpoint.checksums import write_checksums
from openrecipes.utils import atomic_write_text, check_output_dir, guarded_output_dir, read_json

MANIFEST = "openrecipes.json"
# marks a directory as written by `convert import`, so --overwrite may replace it (and nothing else)
NATIVE_MARKER = ".openrecipes-native"


def import_hf(hf_dir: str | Path, ckpt_dir: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """HF safetensors directory -> native DCP directory. Dtypes are kept tensor by tensor."""
    guard = dict(marker=NATIVE_MARKER, writer="openrecipes convert import", overwrite=overwrite, inputs=[hf_dir],
                 option="CKPT_DIR")
    check_output_dir(ckpt_dir, **guard)  # before reading every tensor: a refusal costs nothing
    checkpoint = HFCheckpoint(hf_dir)
    family, config = read_config(checkpoint)
    state = dict(iter_native_tensors(checkpoint, family, config))
    manifest = {
        "format": "openrecipes-native-v1", "writer": f"openrecipes {__version__}", "source": str(hf_dir),
        "tensors": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                    for name, t in state.items()},
    }
    with guarded_output_dir(ckpt_dir, **guard) as staging:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)), no_dist=True)
        atomic_write_text(staging / "config.json", json.dumps(checkpoint.config, indent=2) + "\n")
        write_checksums(staging, no_dist=True)
        # Written last: its presence marks the directory complete.
        atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_native_state(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read every tensor of a native checkpoint into CPU memory, with its HF config."""
    ckpt_dir = Path(ckpt_dir)
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} is missing: {ckpt_dir} is not a complete native checkpoint")
    state = _empty_state(read_json(manifest_path), manifest_path)
    load_dcp(state, ckpt_dir, no_dist=True)  # checksums checked; restricted: a checkpoint's pickles cannot run code
    config = read_json(ckpt_dir / "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{ckpt_dir / 'config.json'}: expected a JSON object")
    return state, config


def _empty_state(manifest: Any, source: Path) -> dict[str, torch.Tensor]:
    """Empty tensors of the shapes and dtypes the manifest lists (what DCP loads into)."""
    try:
        state = {}
        for name, info in manifest["tensors"].items():
            dtype = getattr(torch, info["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"tensor {name!r}: unknown dtype {info['dtype']!r}")
            shape = [int(n) for n in info["shape"]]
            if any(n < 0 for n in shape):
                raise ValueError(f"tensor {name!r}: negative size in shape {shape}")
            state[name] = torch.empty(shape, dtype=dtype)
        return state
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise ValueError(f"{source}: not a native checkpoint manifest ({error})") from None


def export_hf(ckpt_dir: str | Path, hf_dir: str | Path, *, max_shard_bytes: int = 5 * 2**30,
              overwrite: bool = False) -> None:
    """Native DCP directory -> HF safetensors directory (per-expert tensors, index when sharded)."""
    from openrecipes.checkpoint.safetensors_io import HF_MARKER, HF_WRITER
    from openrecipes.models.families import family_for_model_type

    check_output_dir(hf_dir, marker=HF_MARKER, writer=HF_WRITER, overwrite=overwrite, inputs=[ckpt_dir],
                     option="HF_DIR")  # before loading every tensor: a refusal costs nothing
    state, raw_config = load_native_state(ckpt_dir)
    source = str(Path(ckpt_dir) / "config.json")
    family = family_for_model_type(raw_config.get("model_type"), source=source)
    config = family.config_from_hf(raw_config, source)
    write_hf_dir(hf_dir, hf_tensors_from_native(state, family, config), raw_config,
                 max_shard_bytes=max_shard_bytes, overwrite=overwrite, inputs=[ckpt_dir])
