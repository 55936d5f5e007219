"""A YAML loader for recipe cards that accepts plain data only.

Cards come from pull requests and other people's runs, so the loader refuses what plain data
never needs and what can hurt a reader: anchors and aliases (exponential "billion laughs"
expansion, and values that silently change in two places), merge keys, explicit or unknown tags
(`!!python/object`, `!!binary`, `!!set`, local `!tags`), duplicate keys (the last one would win
unnoticed), deep nesting and documents over a size limit. Every refusal names the file and line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from openrecipes.utils import utf8_problem

MAX_CARD_BYTES = 1 << 20  # 1 MiB: the largest seed card is ~10 KiB
MAX_DEPTH = 32

_CORE = "tag:yaml.org,2002:"
# the tags plain data resolves to without being written explicitly
ALLOWED_TAGS = frozenset(
    _CORE + name for name in ("str", "int", "float", "bool", "null", "seq", "map", "timestamp")
)


class UnsafeYamlError(ValueError):
    """A YAML document that is not plain data, or that could not be parsed."""

    def __init__(self, source: str, line: int | None, message: str) -> None:
        self.source = source
        self.line = line
        self.message = message
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")


class _PlainDataLoader(yaml.SafeLoader):
    """SafeLoader that fails on anchors, aliases, merge keys, explicit tags and duplicate keys."""

    source = "<string>"
    _open_collections = 0

    def _fail(self, mark: Any, message: str) -> None:
        raise UnsafeYamlError(self.source, mark.line + 1 if mark is not None else None, message)

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._fail(event.start_mark, f"alias '*{event.anchor}' is not allowed (plain data only)")
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._fail(event.start_mark, f"anchor '&{anchor}' is not allowed (plain data only)")
        tag = getattr(event, "tag", None)
        # an explicit tag, even a core one, is never needed by plain data; `!` is the plain
        # non-specific tag a quoted scalar may carry
        if tag is not None and tag != "!":
            self._fail(event.start_mark, f"tag '{tag}' is not allowed (plain data only)")
        # PyYAML composes recursively: a document nested thousands deep would end in a RecursionError before
        # _check_depth could name its line, so the depth is also counted here (the one collection more is the
        # collection a scalar at MAX_DEPTH sits in, which _check_depth measures)
        opens = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if opens:
            self._open_collections += 1
            if self._open_collections > MAX_DEPTH + 1:
                self._fail(event.start_mark, f"nesting deeper than {MAX_DEPTH}")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._open_collections -= opens
        if node is not None and node.tag not in ALLOWED_TAGS:
            self._fail(node.start_mark, f"tag '{node.tag}' is not allowed (plain data only)")
        return node

    def flatten_mapping(self, node: MappingNode) -> None:
        for key_node, _ in node.value:
            if key_node.tag == _CORE + "merge":
                self._fail(key_node.start_mark, "merge key '<<' is not allowed (plain data only)")
        super().flatten_mapping(node)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except UnsafeYamlError:
            raise
        except (ValueError, OverflowError) as error:  # a value YAML resolves but cannot build: 2026-02-31
            self._fail(node.start_mark, f"invalid value {node.value!r}: {error}" if isinstance(node, ScalarNode)
                       else f"invalid value: {error}")

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode):
                self._fail(key_node.start_mark, "a mapping key must be a plain scalar")
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                self._fail(
                    key_node.start_mark,
                    f"duplicate key {key!r} (first at line {seen[key]})",
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _check_depth(node: Node, source: str, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise UnsafeYamlError(source, node.start_mark.line + 1, f"nesting deeper than {MAX_DEPTH}")
    if isinstance(node, SequenceNode):
        for child in node.value:
            _check_depth(child, source, depth + 1)
    elif isinstance(node, MappingNode):
        for key_node, child in node.value:
            if not isinstance(key_node, ScalarNode):  # a list or mapping as a key: no field is named so
                raise UnsafeYamlError(source, key_node.start_mark.line + 1, "a mapping key must be a plain scalar")
            _check_depth(child, source, depth + 1)


def _line_map(node: Node, prefix: tuple[Any, ...], out: dict[tuple[Any, ...], int]) -> None:
    out[prefix] = node.start_mark.line + 1
    if isinstance(node, SequenceNode):
        for index, child in enumerate(node.value):
            _line_map(child, prefix + (index,), out)
    elif isinstance(node, MappingNode):
        for key_node, child in node.value:
            key = key_node.value
            _line_map(child, prefix + (key,), out)
            # the key's own line is where an unknown, misspelt or wrongly typed field is written
            out[prefix + (key,)] = key_node.start_mark.line + 1


def load_plain_yaml(text: str | bytes, source: str = "<string>") -> tuple[Any, dict[tuple[Any, ...], int]]:
    """Parse one YAML document of plain data.

    Returns the data and a map from a path of keys/indices (e.g. ``("layout", "tp")``) to the
    1-based line where it is written, so later errors can point at the line.
    Raises UnsafeYamlError naming ``source`` and the line.
    """
    raw = text.encode() if isinstance(text, str) else text
    if len(raw) > MAX_CARD_BYTES:
        line = raw[:MAX_CARD_BYTES].count(b"\n") + 1
        raise UnsafeYamlError(
            source, line, f"document is {len(raw)} bytes, over the {MAX_CARD_BYTES}-byte limit "
            f"(the limit is crossed on this line)",
        )
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UnsafeYamlError(source, None, utf8_problem(error)) from None
    try:
        loader = _PlainDataLoader(decoded)
    except yaml.reader.ReaderError as error:  # a character YAML refuses to read (ESC, NUL): one line, its line
        line = decoded.count("\n", 0, error.position) + 1
        raise UnsafeYamlError(source, line, f"character {error.character:#06x} is not allowed in YAML") from None
    loader.source = source
    try:
        node = loader.get_single_node()
        if node is None:
            raise UnsafeYamlError(source, 1, "empty document")
        _check_depth(node, source)
        lines: dict[tuple[Any, ...], int] = {}
        _line_map(node, (), lines)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        problem = error.problem or "invalid YAML"
        raise UnsafeYamlError(source, mark.line + 1 if mark else None, f"YAML syntax: {problem}") from None
    except yaml.YAMLError as error:
        raise UnsafeYamlError(source, None, f"YAML error: {error}") from None
    except ValueError as error:  # a value YAML resolves but cannot build, such as the date 2026-02-31
        if isinstance(error, UnsafeYamlError):
            raise
        raise UnsafeYamlError(source, None, f"invalid value: {error}") from None
    finally:
        loader.dispose()
    return data, lines


def load_plain_yaml_file(path: str | os.PathLike) -> tuple[Any, dict[tuple[Any, ...], int], str]:
    """Read and parse a card file; returns (data, line map, the file's text)."""
    path = Path(path)
    if path.is_dir():
        raise UnsafeYamlError(str(path), None, "is a directory, not a YAML file")
    if path.exists() and not path.is_file():  # a pipe or a device: opening it waits, reading it may never end
        raise UnsafeYamlError(str(path), None, "is not a regular file")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        # read one byte past the limit: enough to refuse without reading a huge file whole
        raw = handle.read(MAX_CARD_BYTES + 1)
    if size > MAX_CARD_BYTES:
        line = raw[:MAX_CARD_BYTES].count(b"\n") + 1
        raise UnsafeYamlError(
            str(path), line, f"file is {size} bytes, over the {MAX_CARD_BYTES}-byte limit "
            f"(the limit is crossed on this line)",
        )
    data, lines = load_plain_yaml(raw, source=str(path))
    return data, lines, raw.decode("utf-8")
