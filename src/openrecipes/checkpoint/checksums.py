"""A sha256 per checkpoint file, written at save and checked at load, so a damaged file is named instead of
silently resumed from (a flipped byte inside a shard still unpickles and loads as different numbers).

CKPT_DIR/checksums.json: {"format": ..., "algorithm": "sha256", "files": {"__0_0.distcp": {"bytes": N,
"sha256": "..."}, ".metadata": {...}, ...}}. It is written after every other file of the save and before the
directory is made complete (renamed into place), so every checkpoint this tool writes has one: a loader of those
(``safe_load.load_dcp``) requires it, and a file of the directory it does not list is refused too (added after the
save, or the list was edited to leave it unchecked). Directories that may come from elsewhere (a PEFT adapter) pass
``required=False`` and are checked only when they have one.

In a multi-process save each rank hashes the files it wrote (``__RANK_*.distcp``) and rank 0 collects them; at load
each rank checks a share of the files and every rank raises the same error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from openrecipes.utils import atomic_write_text, path_inside, sha256_file

CHECKSUMS_FILE = "checksums.json"
FORMAT = "openrecipes-checksums-v1"


def _entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def is_distributed(no_dist: bool) -> bool:
    """Whether a checkpoint is written or read by several processes (``no_dist``: this one alone)."""
    return not no_dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _writer_rank(path: Path) -> int:
    """The rank that wrote a file: DCP names shards __RANK_INDEX.distcp; everything else is rank 0's."""
    parts = path.name.split("_")
    if path.suffix == ".distcp" and len(parts) >= 4 and parts[2].isdigit():
        return int(parts[2])
    return 0


def _own_files(directory: Path, rank: int, distributed: bool) -> list[Path]:
    """The files this rank hashes: the ones it wrote."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != CHECKSUMS_FILE)
    return [p for p in files if _writer_rank(p) == rank] if distributed else files


def write_checksums(directory: str | Path, *, no_dist: bool = False) -> None:
    """Hash the directory's files (collectively when several processes wrote it) and write CHECKSUMS_FILE from
    rank 0. Every rank must call it after its last write."""
    directory = Path(directory)
    distributed = is_distributed(no_dist)
    rank = dist.get_rank() if distributed else 0
    entries = {p.name: _entry(p) for p in _own_files(directory, rank, distributed)}
    if distributed:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entries)
        entries = {name: entry for part in gathered for name, entry in part.items()}
    if rank == 0:
        document = {"format": FORMAT, "algorithm": "sha256", "files": dict(sorted(entries.items()))}
        atomic_write_text(directory / CHECKSUMS_FILE, json.dumps(document, indent=1) + "\n")


def _read_manifest(path: Path) -> dict[str, dict]:
    try:
        document = json.loads(path.read_text())
        files = document["files"]
        if document.get("format") != FORMAT or not isinstance(files, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("bytes"), int)
                for e in files.values()):
            raise ValueError("unexpected content")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"{path}: damaged checksum file ({error})") from None
    for name in files:  # a listed name is opened and hashed: it must not lead out of the checkpoint
        path_inside(path.parent, name, source=path, key="files", plain_name=True)
    return files


def _problem(directory: Path, name: str, entry: dict) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{path}: missing (listed in {CHECKSUMS_FILE})"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{path}: damaged: {size} bytes, {entry['bytes']} when saved (truncated or overwritten)"
    if sha256_file(path) != entry["sha256"]:
        return f"{path}: damaged: its sha256 differs from the one recorded at save ({CHECKSUMS_FILE})"
    return None


def _unlisted_problem(directory: Path, files: dict[str, dict], unlisted: tuple[str, ...]) -> str | None:
    """A file of the directory the checksum file does not list (``unlisted``: names written after it, which carry
    nothing the load reads, like an overwrite marker)."""
    extra = sorted(p.name for p in directory.iterdir()
                   if p.is_file() and p.name not in files and p.name != CHECKSUMS_FILE and p.name not in unlisted)
    if extra:
        return (f"{directory / extra[0]}: not listed in {CHECKSUMS_FILE} (added after the save, or the list was "
                "edited); its content cannot be checked")
    return None


def verify_checksums(directory: str | Path, *, no_dist: bool = False, required: bool = False,
                     unlisted: tuple[str, ...] = ()) -> bool:
    """Check every file listed in CHECKSUMS_FILE, and that it lists every file of the directory but ``unlisted``;
    False when there is none and ``required`` is False (a directory that may come from elsewhere).

    A missing, truncated, changed or unlisted file, or a missing CHECKSUMS_FILE when ``required``, is a ValueError
    (FileNotFoundError when missing) naming it, raised on every rank alike. Every rank must call it."""
    directory = Path(directory)
    manifest_path = directory / CHECKSUMS_FILE
    distributed = is_distributed(no_dist)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problem: str | None = None
    present = manifest_path.is_file()
    files: dict[str, dict] = {}
    if not present and required:
        problem = (f"{manifest_path}: missing from {directory}; every checkpoint openrecipes writes has one (its "
                   "save's last file), so this one was altered or its save never finished")
    elif present:
        try:
            files = _read_manifest(manifest_path)
            problem = _unlisted_problem(directory, files, unlisted)
        except ValueError as error:
            problem = str(error)
            files = {}
    for index, (name, entry) in enumerate(sorted(files.items())):
        if problem is None and index % world == rank:  # each rank reads a share of the bytes
            problem = _problem(directory, name, entry)
    if distributed:
        problems: list = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        missing = problem.endswith(f"(listed in {CHECKSUMS_FILE})") or not present
        raise (FileNotFoundError if missing else ValueError)(problem)
    return present
