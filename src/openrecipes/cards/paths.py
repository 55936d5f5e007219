"""Absolute machine paths in a card: a reader rerunning a published card from a clone has none of them.

A path counts when a whitespace-, quote-, bracket- or separator-delimited token starts with ``/`` and a letter,
dot or underscore (``/tmp/x``, ``/home/u``, ``/.cache``), or with ``/`` and a digit or ``-`` when another ``/``
follows (``/2024data/a``, ``/-scratch/a``), with ``~/`` or ``~user/``, with a drive (``C:\\``, ``C:/``), with the
home, profile or temporary folder's variable (``$HOME/x``, ``${HOME}/x``, ``%USERPROFILE%\\x``; a variable of the
recipe's own, ``$KERNEL_CACHE/x``, is the reader's to set), or is a
UNC share or device path (``\\\\host\\share``, ``\\\\?\\C:\\x``); ``file:`` URLs too, in any case
(``FILE:///x``). A shell default such as ``${DATA:-/home/a/rows}`` holds the path after ``:-``. Other URLs
(``https://``, ``hf://``, ``s3://``) are left out, and so is a ``/`` inside a token: ``tokens/s/GPU``, ``$/1M
tokens``, ``1/3``, dates. Mapping keys are read as well as values.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

Loc = tuple[str | int, ...]

# what may stand right before a path: start of text, whitespace, quotes, brackets, separators, a shell default's -
_BEFORE = r"(?<![^\s'\"`(\[{<=:,;|-])"
# what a path token stops at
_BODY = r"[^\s'\"`()\[\]{}<>,;|:=]*"
_URL = re.compile(r"(?<![A-Za-z0-9+.-])(?!(?i:file):)[A-Za-z][A-Za-z0-9+.-]*://\S*")
_FILE_URL = re.compile(r"(?<![A-Za-z0-9+.-])(?i:file):/\S*")
_PATH = re.compile(_BEFORE + "(?:" + "|".join((
    r"(?i:file):/" + _BODY,  # file:///tmp/x, file:/tmp/x, FILE:///x
    r"[A-Za-z]:[\\/](?![\\/])" + _BODY,  # C:\Users\x, C:/Users/x
    r"\\\\[A-Za-z0-9._$?-]+\\" + _BODY + r"(?::[\\/]" + _BODY + ")?",  # \\host\share, \\?\C:\x, \\.\x
    r"~(?:[A-Za-z_][A-Za-z0-9_.-]*)?/" + _BODY,  # ~/x, ~user/x
    r"\$(?:HOME|TMPDIR|\{HOME\}|\{TMPDIR\})/" + _BODY,  # $HOME/x, ${HOME}/x
    r"(?i:%(?:USERPROFILE|HOMEPATH|APPDATA|LOCALAPPDATA|TEMP|TMP)%)[\\/]" + _BODY,  # %USERPROFILE%\x
)) + ")")
# /tmp/x, /.cache, /_x; /2024data/a and /-scratch/a only with a second part (not /3 or /-)
_POSIX = re.compile(_BEFORE + r"/(?:[A-Za-z._]|[0-9-][^\s'\"`()\[\]{}<>,;|:=/]*/)" + _BODY)
_TRAILING = ".:"  # sentence punctuation after a path
# one slash and no spaces: a Hugging Face id (org/name), or its URL
_HUB_ID = re.compile(r"^(?:https?://huggingface\.co/(?:datasets/)?|hf://(?:datasets/)?)?[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_source(source: str) -> bool:
    """Whether ``source`` names a Hugging Face repository (its first word is org/name or a huggingface.co URL)."""
    words = source.split()
    return bool(words) and bool(_HUB_ID.match(words[0].rstrip(":;,")))


def local_path_text(path: str) -> str:
    """A relative file path as a card writes it: ``in/docs.jsonl`` becomes ``./in/docs.jsonl``, so that it cannot
    read as a hub repository's ``org/name`` (whose revision a verified card must pin)."""
    return f"./{path}" if is_hub_source(path) else path


def _strip(token: str) -> str:
    return token.rstrip(_TRAILING) or token


def paths_in_text(text: str) -> list[str]:
    """The absolute machine paths in one string, in order, each once."""
    masked = _URL.sub(lambda m: " " * len(m.group()), text)
    found: list[tuple[int, str]] = []
    taken: list[range] = []
    for pattern in (_PATH, _POSIX):
        for match in pattern.finditer(masked):
            if any(match.start() in span for span in taken):
                continue  # the /x of C:/x or file:/x, already reported whole
            taken.append(range(match.start(), match.end()))
            found.append((match.start(), _strip(text[match.start():match.end()])))
    return list(dict.fromkeys(path for _, path in sorted(found)))


def _walk(tree: Any, loc: Loc) -> Iterator[tuple[Loc, str]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            for path in paths_in_text(key) if isinstance(key, str) else ():  # an env key, a mapping's name
                yield (*loc, str(key)), path
            yield from _walk(value, (*loc, str(key)))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _walk(value, (*loc, index))
    elif isinstance(tree, str):
        for path in paths_in_text(tree):
            yield loc, path


def find_absolute_paths(tree: Any) -> list[tuple[Loc, str]]:
    """(field location, path) for every absolute machine path in every string of a loaded YAML tree."""
    return list(_walk(tree, ()))


def dotted(loc: Loc) -> str:
    """('workload', 'dataset', 'source') -> 'workload.dataset.source'; list indices as [i]."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def absolute_paths(tree: Any) -> list[tuple[str, str]]:
    """(dotted field path, path) for every absolute machine path in every string of a loaded card tree."""
    return [(dotted(loc), path) for loc, path in find_absolute_paths(tree)]


def is_catalog_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies in a repository's ``recipes/`` catalog: a ``recipes`` directory beside the
    repository's ``.git`` or ``pyproject.toml``. A ``recipes`` directory elsewhere (a tuner's output) is not one."""
    for parent in Path(os.path.abspath(path)).parents:
        if parent.name == "recipes" and any((parent.parent / marker).exists() for marker in (".git", "pyproject.toml")):
            return True
    return False


def _relative(token: str, bases: list[PurePosixPath]) -> str:
    path = PurePosixPath(os.path.normpath(token))
    for base in bases:
        if path == base or base in path.parents:
            return local_path_text(str(path.relative_to(base)))
    return token


def relative_to(tree: Any, base: str | os.PathLike) -> Any:
    """A copy of ``tree`` whose strings name absolute paths under ``base`` relative to it (others are kept)."""
    bases = [PurePosixPath(os.path.abspath(base))]
    if str(Path(base).resolve()) != str(bases[0]):
        bases.append(PurePosixPath(str(Path(base).resolve())))
    if any(b.parent == b for b in bases):  # the filesystem root: every path is "under" it
        return tree

    def text(value: str) -> str:
        masked = _FILE_URL.sub(lambda m: " " * len(m.group()), _URL.sub(lambda m: " " * len(m.group()), value))
        pieces, last = [], 0
        for match in _POSIX.finditer(masked):
            token = _strip(value[match.start():match.end()])
            pieces += [value[last:match.start()], _relative(token, bases)]
            last = match.start() + len(token)
        return "".join(pieces) + value[last:]

    return _map_strings(tree, text)


def named_by_file(tree: Any) -> Any:
    """A copy of ``tree`` whose absolute machine paths are named by their last part and where they were, for a card
    that must hold none (the tuner's): the rows are named by their build and hash beside such a name."""
    def text(value: str) -> str:
        for path in sorted(paths_in_text(value), key=len, reverse=True):  # /a/b/c before /a/b
            name = PurePosixPath(path.replace("\\", "/").rstrip("/")).name or path.strip("/\\:~")
            value = value.replace(path, f"{name} (a path on the machine it ran on)")
        return value

    return _map_strings(tree, text)


def _map_strings(tree: Any, text: Callable[[str], str]) -> Any:
    """A copy of a loaded YAML tree with ``text`` applied to every string in it."""
    if isinstance(tree, dict):
        return {key: _map_strings(item, text) for key, item in tree.items()}
    if isinstance(tree, list):
        return [_map_strings(item, text) for item in tree]
    return text(tree) if isinstance(tree, str) else tree
