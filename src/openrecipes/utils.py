"""Small helpers shared across packages: atomic file and directory writes, hashing, plot axis ticks."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file's content; malformed JSON is a ValueError naming the file and position."""
    import json

    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    except UnicodeDecodeError as error:  # binary garbage
        raise ValueError(f"{path}: not valid JSON (not UTF-8 text: {error.reason} at byte {error.start})") from None
    except RecursionError:  # [[[[...]]]] a hundred thousand deep: the parser's recursion, not a traceback
        raise ValueError(f"{path}: not valid JSON (nested too deeply to read)") from None


def iter_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSON Lines file; malformed JSON or a non-object is a
    ValueError naming the file and line."""
    import json

    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{line_no}: {utf8_problem(error)}") from None
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_no}: malformed JSON: {error.msg}") from None
            except RecursionError:
                raise ValueError(f"{path}:{line_no}: JSON nested too deeply to read") from None
            except ValueError as error:  # an integer past Python's digit limit
                raise ValueError(f"{path}:{line_no}: unreadable JSON ({one_line(error)[:120]})") from None
            if not isinstance(data, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object")
            yield line_no, data


def path_inside(folder: str | os.PathLike, name: Any, *, source: str | os.PathLike, key: str,
                plain_name: bool = False, links_may_leave: bool = False) -> Path:
    """``folder / name`` for a ``name`` read from the file ``source`` (under ``key``), refused unless it stays inside
    ``folder``.

    A name read from a file that someone else may have written could otherwise reach any file of the person running
    the tool: ``..`` parts, an absolute path, an empty name, a backslash or a NUL, or a symbolic link (of the name
    or of a folder on its way) that resolves outside ``folder`` are a ValueError naming the file, the key and the
    name. ``plain_name``: a file name only, no sub-folders. ``links_may_leave``: only for folders whose files are
    links by design (a Hugging Face cache snapshot links each file to a blob beside the snapshot)."""
    problem = _outside_reason(name, plain_name)
    path = Path(folder) / name if problem is None else None
    if path is not None and not links_may_leave:
        resolved = path.resolve()
        if Path(folder).resolve() not in resolved.parents:
            problem = f"through a symbolic link it resolves to {resolved}"
    if problem is not None:
        raise ValueError(f"{source}: {key}: {name!r} is not a {'file name' if plain_name else 'path'} inside "
                         f"{folder} ({problem})")
    return path


def _outside_reason(name: Any, plain_name: bool) -> str | None:
    """Why ``name``, as written, may leave its folder (None when it cannot)."""
    if not isinstance(name, str):
        return f"not a string but {type(name).__name__}"
    if not name or "\0" in name or "\\" in name:
        return "empty, or holds a NUL or a backslash"
    pure = Path(name)
    if pure.is_absolute():
        return "an absolute path"
    if ".." in pure.parts:
        return "it climbs out with '..'"
    if not pure.parts:
        return "it names the folder itself"
    if plain_name and pure.name != name:
        return "it names a sub-folder"
    return None


def utf8_problem(error: UnicodeDecodeError) -> str:
    """What is wrong with a file that is not UTF-8, as the one-line errors that name it say it."""
    return f"not UTF-8 text ({error.reason} at byte {error.start})"


def one_line(text: Any) -> str:
    """Text from an input (a key, a template's message, a file name) as it may stand inside a one-line error: its
    line breaks and control characters written as escapes, so it can neither add a line of its own nor move the
    cursor, clear the screen or retitle the terminal."""
    return str(text).translate(_CONTROLS)


# every character str.splitlines breaks at and every other control character but the tab (C0, DEL, C1), as its escape
_CONTROLS = {ord(c): repr(c)[1:-1] for c in ["\u2028", "\u2029"] + [chr(n) for n in (*range(32), *range(127, 160))
                                                                       if n != 9]}


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def host_memory_bytes() -> int:
    """This host's physical memory: what a CPU run's card states as its device memory (its processes share it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def current_umask() -> int:
    """The process's umask, which the atomic writers apply to their outputs as ``open`` and ``mkdir`` would."""
    try:  # Linux reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` only on success.

    A crash or an exception leaves the old file (or nothing), never a half-written one.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 would make every output private to its writer
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a staging directory beside ``path``; it becomes ``path`` only when the block succeeds.

    A failed or interrupted write leaves at most a hidden ``.<name>.partial-*`` directory,
    never a directory at ``path`` that looks complete.
    """
    target = Path(path)
    if target.exists() and not overwrite and any(target.iterdir()):
        raise FileExistsError(f"output directory {target} exists and is not empty")
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # deepest first
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    finished = False
    try:
        with _terminated_as_exit():  # a SIGTERM (a job's time limit, kill) still cleans up below
            yield staging
            os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp's 0700, as a plain mkdir would have made it
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
            finished = True
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        for parent in made if not finished else ():  # a failed write leaves no folder it made
            with contextlib.suppress(OSError):
                parent.rmdir()


@contextlib.contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """SIGTERM as SystemExit(143) inside the block, so its cleanup runs (the main thread, and only where no one else
    handles the signal)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def register_modules(subparsers: Any, modules: Iterable[str]) -> None:
    """Let each module add its (sub)command with its ``register(subparsers)``: the one registration step of
    ``openrecipes`` and of its verb groups."""
    import importlib

    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)


def check_apart_from_inputs(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], *,
                            option: str = "--out") -> None:
    """The rule every verb that writes keeps: its output is never one of its inputs, never holds one and never sits
    inside one, compared as real paths (links and ``..`` resolved), so writing it can neither replace nor alter
    what the command reads. ``None`` among ``inputs`` (an input not given) is skipped."""
    resolved = Path(output).resolve()
    for source in inputs:
        if source is None:
            continue
        source_path = Path(source).resolve()
        if source_path == resolved or resolved in source_path.parents:
            raise ValueError(f"{option}: {output} is or holds the input {source}; writing there would replace it")
        if source_path in resolved.parents:
            raise ValueError(f"{option}: {output} sits inside the input {source}; write it elsewhere")


def check_output_file(path: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], *,
                      option: str = "--out") -> None:
    """Refuse an output file that is a directory or a symbolic link, or that breaks ``check_apart_from_inputs``."""
    target = Path(path)
    if target.is_symlink():
        raise ValueError(f"{option}: {target} is a symbolic link; give the file itself")
    if target.is_dir():
        raise ValueError(f"{option}: {target} is a directory; give a file name")
    check_apart_from_inputs(target, inputs, option=option)


def nearest_existing_parent(path: Path) -> Path | None:
    """The closest folder above ``path`` that exists (a file there means ``path`` cannot be made)."""
    return next((parent for parent in path.absolute().parents if parent.exists()), None)


def check_output_dir(path: str | os.PathLike, *, marker: str, writer: str, overwrite: bool,
                     inputs: Iterable[str | os.PathLike | None] = (), option: str = "--out",
                     reused: bool = False) -> None:
    """Refuse an output directory whose replacement could delete something this tool did not write.

    Allowed: a missing or empty directory, or, with ``overwrite``, one holding ``marker`` (the file an earlier
    ``writer`` left there) that lists every file and folder beside it (``mark_output_dir``). ``reused``: the writer
    only adds its own files to the directory and never clears it, so the marker alone suffices. Always refused: the
    current directory or one that contains it, a directory that is, holds or sits inside one of ``inputs``
    (``check_apart_from_inputs``), a symbolic link, a file, and a non-empty directory without the marker.
    """
    target = Path(path)
    if target.is_symlink():
        raise ValueError(f"{option}: {target} is a symbolic link; give the directory itself")
    resolved = target.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise ValueError(f"{option}: {target} is the current directory or contains it; give a new directory")
    check_apart_from_inputs(target, inputs, option=option)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{option}: {target} exists and is not a directory")
    existing = nearest_existing_parent(target)
    if existing is not None and not existing.is_dir():
        raise NotADirectoryError(f"{option}: {existing} is not a directory, so {target} cannot be made in it")
    if not target.exists() or not any(target.iterdir()):
        return
    if not (target / marker).is_file():  # --overwrite would not replace it either: say so first
        raise ValueError(f"{option}: {target} is not empty and was not written by {writer} (it has no {marker} "
                         "file); choose another directory or empty it yourself")
    if not overwrite:
        raise FileExistsError(f"{option}: {target} exists and is not empty (pass --overwrite to replace an "
                              f"earlier output of {writer})")
    if reused:
        return
    header, *written = (target / marker).read_text(encoding="utf-8", errors="replace").splitlines() or [""]
    if header != _marker_header(writer):  # an older marker lists nothing: what is ours there cannot be told
        raise ValueError(f"{option}: {target}/{marker} does not list what {writer} wrote there (an older version or "
                         "another program left it), so --overwrite cannot tell its files from yours; remove the "
                         "directory yourself or choose another")
    foreign = [entry for entry in _entries(target) if entry not in written and entry != marker]
    if foreign:
        raise ValueError(f"{option}: {target} holds {foreign[0]!r}, which {writer} did not write; move it "
                         f"away or choose another directory (--overwrite replaces only what {writer} wrote)")


@contextlib.contextmanager
def guarded_output_dir(path: str | os.PathLike, *, marker: str, writer: str, overwrite: bool = False,
                       inputs: Iterable[str | os.PathLike | None] = (), option: str = "--out") -> Iterator[Path]:
    """``atomic_output_dir`` behind ``check_output_dir``: the finished directory carries ``marker``, so a later
    ``--overwrite`` may replace it and nothing else."""
    check_output_dir(path, marker=marker, writer=writer, overwrite=overwrite, inputs=inputs, option=option)
    with atomic_output_dir(path, overwrite=True) as staging:
        yield staging
        mark_output_dir(staging, marker=marker, writer=writer)


def mark_output_dir(directory: Path, *, marker: str, writer: str) -> None:
    """Leave ``marker`` in a finished output: its writer, then every file and folder it holds, which is all a later
    ``--overwrite`` may replace (``check_output_dir``)."""
    listing = "".join(f"{entry}\n" for entry in _entries(directory) if entry != marker)
    (directory / marker).write_text(_marker_header(writer) + "\n" + listing)


def _marker_header(writer: str) -> str:
    """The first line of an output's marker; the lines after it list the output's files and folders."""
    return f"written by {writer}; --overwrite may replace this directory, which holds:"


def _entries(directory: Path) -> list[str]:
    """Every file and folder under ``directory``, as paths relative to it."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))


def shown_step(step: int) -> int:
    """A step as people read it (the console's progress line, the site's axes, windows and texts): counted from 1,
    as TRL's and torchtitan's logs count. The files (metrics.jsonl's ``step``, a card's curves and windows) count
    from 0; only what is shown converts, here."""
    return step + 1


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values inside [low, high]: steps of 1, 2 or 5 times a power of ten, about ``count`` of them."""
    span = high - low
    if not span > 0:
        return [low]
    raw = span / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    ticks, index = [], math.ceil(low / step - 1e-9)
    while index * step <= high + step * 1e-9:
        ticks.append(round(index * step, 12))
        index += 1
    return ticks


def tick_labels(ticks: list[float]) -> list[str]:
    """The ticks' text as a reader writes it, never in scientific notation: 1,240 below ten thousand, 12.4k and
    3.5M above (one suffix for the whole axis, chosen by its largest tick), and as many decimals as the step between
    ticks needs (0.05: two)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else abs(ticks[0]) if ticks else 0.0
    largest = max((abs(v) for v in ticks), default=0.0)
    scale, suffix = next(((s, x) for s, x in ((1e6, "M"), (1e3, "k")) if largest >= 10 * s or
                          (x == "M" and largest >= s)), (1.0, ""))
    decimals = _decimals(step / scale)
    return [f"{v / scale:,.{decimals}f}{suffix}" if v else "0" for v in ticks]


def _decimals(step: float) -> int:
    if not step > 0 or step >= 1:
        return 0
    return min(12, max(0, -math.floor(math.log10(step) + 1e-9)))
