"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP stores its ``.metadata`` file as a pickle and reads it with ``pickle.load``; non-tensor items (an optimizer's
``lr``, ``betas``) are pickles read with ``torch.load(weights_only=False)``. Unpickling calls whatever the file
names, so a planted checkpoint could run a shell command. Here the metadata goes through an unpickler that only
builds DCP's own metadata classes and the plain torch values they hold, and byte items through
``torch.load(weights_only=True)``; anything else is refused with a ValueError naming the file. Every directory read
here is one this tool wrote, so its checksum file is required (``checksums.py``), and every floating-point tensor
read must be finite (``finite.py``).
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from openrecipes.checkpoint.checksums import is_distributed, verify_checksums
from openrecipes.checkpoint.finite import first_nonfinite, nonfinite_message
from openrecipes.utils import path_inside

METADATA_FILE = ".metadata"

_DCP_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                         "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
# Every global a DCP metadata pickle of these checkpoints names (checked on real saves); each only builds a value.
_ALLOWED_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout (torch.strided) up by name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
    ("collections", "OrderedDict"),
}


class _Refused(ValueError):
    """A metadata pickle naming something outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the allow-listed globals (and torch dtypes), so loading builds data only."""

    def __init__(self, handle, source: Path) -> None:
        super().__init__(handle)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{self.source}: refused to load: its pickle names {module}.{name}, which is not part of "
                         "DCP checkpoint metadata (unpickling it could run code); see 'Trusted inputs' in "
                         "docs/run-dir.md")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"{self.source}: refused to load: unexpected persistent id in checkpoint metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """A DCP ``.metadata`` file's content, built through the restricted unpickler; ValueError naming the file when
    it is refused, truncated or not DCP metadata."""
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, path).load()
    except _Refused as refused:
        raise ValueError(str(refused)) from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: not a complete checkpoint") from None
    except Exception as error:  # truncated or garbled bytes surface as many exception types
        raise ValueError(f"{path}: not readable checkpoint metadata ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: not checkpoint metadata (holds a {type(metadata).__name__})")
    _check_storage_paths(metadata, path)
    return metadata


def _check_storage_paths(metadata: Metadata, path: Path) -> None:
    """Every tensor's storage file is a plain file name inside the checkpoint: DCP opens ``relative_path`` as it
    stands, so ``../../elsewhere.bin`` would load another file's values under a model tensor's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    storage = metadata.storage_data
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise ValueError(f"{path}: storage_data is a {type(storage).__name__}, not a mapping of items to files")
    checked: set[str] = set()  # each file once: a save has few files and many items in each
    for index, info in storage.items():
        fqn = getattr(index, "fqn", index)
        if not isinstance(info, _StorageInfo):
            raise ValueError(f"{path}: storage_data[{fqn!r}] is a {type(info).__name__}, not a storage entry")
        name = getattr(info, "relative_path", None)
        if isinstance(name, str) and name in checked:
            continue
        path_inside(path.parent, name, source=path, key=f"storage_data[{fqn!r}].relative_path", plain_name=True)
        checked.add(name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with ``read_metadata`` going through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as error:  # the weights-only unpickler refuses code and garbled bytes alike
            raise ValueError(f"checkpoint item {fqn!r}: refused or unreadable ({error})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_dcp(state: dict, ckpt_dir: str | Path, *, no_dist: bool = False, unlisted: tuple[str, ...] = ()) -> None:
    """Fill ``state`` in place from the DCP directory ``ckpt_dir`` without running code from its files, after
    checking the files against their checksums (required: every save writes them; ``unlisted``: files written after
    them, see ``verify_checksums``), then check that every floating-point tensor read is finite.

    Every failure is a ValueError (or FileNotFoundError) naming the directory or file, never DCP's multi-rank
    traceback."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    # a damaged file is named before any byte of it is used
    verify_checksums(ckpt_dir, no_dist=no_dist, required=True, unlisted=unlisted)
    # read once up front: a refusal is then this function's one-line error rather than DCP's rank-local fallback
    metadata = read_dcp_metadata(ckpt_dir / METADATA_FILE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
            dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt_dir)), planner=SafeLoadPlanner(),
                     no_dist=no_dist)
    except CheckpointException as error:  # a BaseException carrying each rank's failure
        causes = [exc for exc, _ in error.failures.values()]
        first = causes[0] if causes else error
        if isinstance(first, (ValueError, FileNotFoundError)) and str(ckpt_dir) in str(first):
            raise type(first)(str(first)) from None
        raise ValueError(f"{ckpt_dir}: cannot load checkpoint ({type(first).__name__}: {first})") from None
    except (ValueError, FileNotFoundError):
        raise
    except Exception as error:
        raise ValueError(f"{ckpt_dir}: cannot load checkpoint ({type(error).__name__}: {error})") from None
    _check_finite(state, ckpt_dir, metadata, no_dist)


def _check_finite(state: dict, ckpt_dir: Path, metadata: Metadata, no_dist: bool) -> None:
    """Refuse a load whose tensors hold NaN or inf, naming the file that stores the first such tensor; each rank
    checks what it read (a shard of a sharded tensor) and every rank raises the same error."""
    import torch.distributed as dist

    bad = first_nonfinite(state)
    if is_distributed(no_dist):
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad)
        bad = next((name for name in found if name), None)
    if bad is None:
        return
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    files = sorted({info.relative_path for index, info in storage.items() if getattr(index, "fqn", None) == bad})
    source = ckpt_dir / files[0] if len(files) == 1 else ckpt_dir
    raise ValueError(nonfinite_message(source, bad) + " (a save refuses NaN or inf, so this one was altered)")
