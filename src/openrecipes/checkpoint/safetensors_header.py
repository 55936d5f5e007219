"""A bounded, validated reader of one safetensors file, for small untrusted files (a LoRA adapter).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to its
``dtype``, ``shape`` and ``data_offsets`` [begin, end) (relative to the data region that follows the header), and the
data. Every claim of the header is checked against the file before a byte of data is read: the header fits in the
file, each span lies inside the data region, spans do not overlap, and each span is exactly its shape times its
dtype's size. Any failure is a one-line ValueError naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAX_HEADER_BYTES = 100 * 2**20  # the limit the safetensors library itself applies
# every dtype the format names, with its size in bytes (sub-byte formats are left out: nothing here reads them)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
TORCH_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"names {sorted({k for k in keys if keys.count(k) > 1})!r} more than once")
    return dict(pairs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(path: Path, name: str, raw: Any, data_start: int, data_bytes: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{where}: its header entry is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise ValueError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise ValueError(f"{where}: data_offsets {offsets} lie outside the data region ({data_bytes} bytes)")
    if math.prod(shape) * DTYPE_BYTES[dtype] != end - begin:
        raise ValueError(f"{where}: shape {shape} of {dtype} needs {math.prod(shape) * DTYPE_BYTES[dtype]} bytes, "
                         f"but data_offsets span {end - begin}")
    return TensorEntry(dtype, tuple(shape), data_start + begin, data_start + end)


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """The validated tensor table of the safetensors file ``path`` (the ``__metadata__`` entry checked, not kept)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise ValueError(f"{path}: header length {length} runs past the end of the file ({size} bytes)")
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {length} is beyond the {MAX_HEADER_BYTES} bytes a header holds")
        text = handle.read(length)
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ValueError(f"{path}: safetensors header is not valid JSON ({type(error).__name__}: "
                         f"{str(error)[:200]})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: safetensors __metadata__ is not a mapping of strings")
    data_start = 8 + length
    entries = {name: _entry(path, name, raw, data_start, size - data_start) for name, raw in header.items()}
    previous_end, previous = data_start, None
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin < previous_end:
            raise ValueError(f"{path}: tensors {previous!r} and {name!r} overlap in the data region")
        previous_end, previous = entry.end, name
    return entries


def read_tensor(path: str | Path, name: str, entry: TensorEntry) -> torch.Tensor:
    """Tensor ``name`` of a validated entry; only the float dtypes of ``TORCH_FLOAT_DTYPES`` are read."""
    dtype = TORCH_FLOAT_DTYPES[entry.dtype]
    if entry.end == entry.begin:
        return torch.empty(entry.shape, dtype=dtype)
    with open(path, "rb") as handle:
        handle.seek(entry.begin)
        data = bytearray(handle.read(entry.end - entry.begin))
    if len(data) != entry.end - entry.begin:
        raise ValueError(f"{path}: tensor {name!r} is cut short (the file changed while it was read)")
    return torch.frombuffer(data, dtype=dtype).reshape(entry.shape)
