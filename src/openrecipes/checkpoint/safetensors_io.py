"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from openrecipes.checkpoint.finite import require_finite
from openrecipes.models.resolve import read_hf_config
from openrecipes.utils import atomic_write_path, atomic_write_text, check_output_dir, guarded_output_dir, path_inside

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# marks a directory as written here, so --overwrite may replace it (and nothing else)
HF_MARKER = ".openrecipes-hf"
HF_WRITER = "openrecipes (Hugging Face export)"


class HFCheckpoint:
    """Lazy view of an HF checkpoint directory: which file holds which tensor, and reading them on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config: dict = read_hf_config(self.path)
        self._handles: dict[str, object] = {}
        self.file_of: dict[str, str] = self._locate_tensors()

    def _locate_tensors(self) -> dict[str, str]:
        index_path = self.path / INDEX_NAME
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as error:
                raise ValueError(f"{index_path}: not a safetensors index ({error})") from error
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index_path}: weight_map is not a mapping of tensor names to file names")
            for file_name in sorted(set(weight_map.values())):
                # a shard is a plain file name in this directory (``../x.safetensors`` or ``/etc/x`` would read, and
                # an export then copy, a file from elsewhere); links may leave it: the Hugging Face cache links
                # each snapshot's files to blobs outside the snapshot
                path_inside(self.path, file_name, source=index_path, key="weight_map", plain_name=True,
                            links_may_leave=True)
                if not (self.path / file_name).is_file():
                    first = next(k for k, v in weight_map.items() if v == file_name)
                    raise FileNotFoundError(f"{self.path / file_name}: shard listed in {INDEX_NAME} is missing "
                                            f"(it holds {first!r} and others)")
            return dict(weight_map)
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors files and no {INDEX_NAME}")
        file_of: dict[str, str] = {}
        for file_name in files:
            for key in self._open(file_name).keys():
                if key in file_of:
                    raise ValueError(f"tensor {key!r} appears in both {file_of[key]} and {file_name}")
                file_of[key] = file_name
        return file_of

    def _open(self, file_name: str):
        if file_name not in self._handles:
            try:
                self._handles[file_name] = safe_open(str(self.path / file_name), framework="pt")
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{self.path / file_name}: cannot read safetensors file ({error})") from error
        return self._handles[file_name]

    def keys(self) -> list[str]:
        return list(self.file_of)

    def get(self, key: str) -> torch.Tensor:
        file_name = self.file_of[key]
        handle = self._open(file_name)
        try:
            tensor = handle.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise ValueError(f"tensor {key!r} in {self.path / file_name}: cannot be read ({error})") from error
        return require_finite(tensor, key, self.path / file_name)

    def get_slice(self, key: str, *index: slice) -> torch.Tensor:
        """``tensor[index]``, reading only that part of the file (e.g. one half of a fused gate_up_proj)."""
        file_name = self.file_of[key]
        try:
            tensor = self._open(file_name).get_slice(key)[index]
        except (SafetensorError, OSError, RuntimeError) as error:
            raise ValueError(f"tensor {key!r} in {self.path / file_name}: cannot be read ({error})") from error
        return require_finite(tensor, key, self.path / file_name)

    def metadata(self, key: str) -> tuple[tuple[int, ...], str]:
        """Shape and dtype without reading the data."""
        file_name = self.file_of[key]
        try:  # the index may list a tensor under a shard that does not hold it
            piece = self._open(file_name).get_slice(key)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise ValueError(f"tensor {key!r} in {self.path / file_name}: cannot be read ({error})") from error
        return tuple(piece.get_shape()), piece.get_dtype()


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, through the atomic writer: safetensors creates its files 0600, a plain open 0644."""
    with atomic_write_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def write_hf_dir(path: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], config: dict, *,
                 max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
                 extra_files: dict[str, str] | None = None, inputs: Iterable[str | Path] = (),
                 option: str = "HF_DIR") -> None:
    """Write an HF checkpoint directory atomically; more than one shard gets a ``model.safetensors.index.json``.

    ``path`` may replace only an earlier export (``overwrite``), never a directory holding one of ``inputs``."""
    guard = dict(marker=HF_MARKER, writer=HF_WRITER, overwrite=overwrite, inputs=inputs, option=option)
    check_output_dir(path, **guard)  # before ``tensors`` is consumed: a refusal costs no conversion
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.contiguous()
        shard_bytes += size
    with guarded_output_dir(path, **guard) as staging:
        if len(shards) == 1:
            _save_shard(shards[0], staging / SINGLE_NAME)
        else:
            weight_map: dict[str, str] = {}
            total = 0
            for i, shard in enumerate(shards):
                file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _save_shard(shard, staging / file_name)
                weight_map.update({name: file_name for name in shard})
                total += sum(t.numel() * t.element_size() for t in shard.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            atomic_write_text(staging / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        atomic_write_text(staging / "config.json", json.dumps(config, indent=2) + "\n")
        for file_name, text in (extra_files or {}).items():
            atomic_write_text(staging / file_name, text)
