"""Record inputs: JSON Lines, a JSON array of records (``.json``), Parquet, or a local Hugging Face dataset directory.

Conversations (a ``messages`` column) for SFT rows and text documents (a ``text`` column) for pretraining rows
come from the same three kinds of input; ``column`` names the one a build needs.

Every record is read and checked once up front (``scan``), so a malformed JSON line stops the
build with its file and line number before anything is written, and the counts in the
manifest cover the whole input. The build then reads the records it needs again, by index,
in the order of its seeded permutation, one at a time (``iter_records``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from openrecipes.data.chat_input import ROLES, ChatInput, InvalidConversation, Markers, shape_message
from openrecipes.utils import one_line

__all__ = ["ChatInput", "ConversationSource", "InvalidConversation", "ROLES", "normalize", "open_source"]
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SCAN_BATCH = 4096


def _drop_nulls(value: Any) -> Any:
    """Parquet/Arrow structs cannot tell an absent field from a null one: drop null fields."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


@dataclass(kw_only=True)
class _File:
    path: Path
    kind: str  # "jsonl", "array" (a JSON array of records) or "table"
    count: int = 0
    line_offsets: np.ndarray | None = None  # jsonl, array: byte offset of each record's line (array: in ``spill``)
    line_numbers: np.ndarray | None = None  # jsonl: 1-based line number of each record
    table: Any = None  # pyarrow.Table with a messages column
    spill: Any = None  # array: an unlinked temporary file holding the records as JSON Lines

    def where(self, local: int) -> str:
        if self.kind == "jsonl":
            return f"{self.path} line {int(self.line_numbers[local])}"
        if self.kind == "array":
            return f"{self.path} record {local + 1}"
        return f"{self.path} row {local + 1}"


def _json_lines(path: Path, f: _File) -> Iterator[tuple[str, Any]]:
    """Yield (where, record) per non-blank line, filling ``f``'s offsets as it goes."""
    offsets: list[int] = []
    numbers: list[int] = []
    offset = 0
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():  # blank lines (e.g. a trailing newline) carry no record
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    kinds = " (a .json input holds a JSON array of records or JSON Lines)" if path.suffix == ".json" \
                        else ""
                    raise ValueError(f"{path} line {number}: malformed JSON: {error}{kinds}") from None
                except ValueError as error:  # a number past Python's limit of digits, say
                    raise ValueError(f"{path} line {number}: unreadable JSON: {error}") from None
                except RecursionError:
                    raise ValueError(f"{path} line {number}: JSON nested too deeply to read") from None
                offsets.append(offset)
                numbers.append(number)
                yield f"{path} line {number}", record
            offset += len(line)
    f.line_offsets = np.asarray(offsets, dtype=np.int64)
    f.line_numbers = np.asarray(numbers, dtype=np.int64)
    f.count = len(offsets)


def _is_json_array(path: Path) -> bool:
    """A ``.json`` file is a JSON array of records when its first non-blank character is ``[``; else JSON Lines
    (what ``datasets``' ``to_json`` writes under that suffix)."""
    with open(path, "rb") as handle:
        while chunk := handle.read(4096):
            if stripped := chunk.lstrip():
                return stripped.startswith(b"[")
    return False


def _json_array(path: Path, f: _File) -> Iterator[tuple[str, Any]]:
    """Yield (where, record) per element of the JSON array in ``path`` (``_is_json_array``), parsed once; the records are spilled one a
    line into an unlinked temporary file (``f.spill``), so the build reads them again by index as from JSON Lines
    and the parsed array is not held."""
    import tempfile

    try:
        with open(path, "rb") as handle:
            records = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        where = f"line {error.lineno}: " if isinstance(error, json.JSONDecodeError) else ""
        raise ValueError(f"{path}: {where}malformed JSON: {error}") from None
    except ValueError as error:  # a number past Python's limit of digits, say
        raise ValueError(f"{path}: unreadable JSON: {error}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None
    f.spill = tempfile.TemporaryFile(prefix="openrecipes-input-", suffix=".jsonl")
    offsets = np.zeros(len(records), dtype=np.int64)
    for local in range(len(records)):
        record, records[local] = records[local], None  # each record freed once spilled
        offsets[local] = f.spill.tell()
        f.spill.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
        yield f"{path} record {local + 1}", record
    f.line_offsets, f.count = offsets, len(offsets)


def _columns(path: Path, names: list[str], column: str) -> list[str]:
    if column not in names:
        raise ValueError(f"{path}: no {column!r} column (columns: {', '.join(names)})")
    # the conversation's tools may sit beside its messages; a text document is its text alone
    extra = ("metadata", "tools") if column == "messages" else ()
    return [name for name in (column, *extra) if name in names]


def _mapped_parquet(path: Path, column: str) -> Any:
    """A Parquet file's columns as a memory-mapped table: decompressed one row group at a time into an uncompressed
    Arrow file in the temporary directory (removed at once; the mapping keeps it readable), so the records are read
    from the page cache by index, never all held in the process's memory."""
    import os
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    keep = _columns(path, parquet.schema_arrow.names, column)
    schema = pa.schema([parquet.schema_arrow.field(name) for name in keep])
    handle, spill = tempfile.mkstemp(prefix="openrecipes-input-", suffix=".arrow")
    os.close(handle)
    try:
        with pa.OSFile(spill, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for group in range(parquet.num_row_groups):
                writer.write_table(parquet.read_row_group(group, columns=keep).cast(schema))
        return pa.ipc.open_file(pa.memory_map(spill)).read_all()
    finally:
        os.unlink(spill)


def _table_or_error(path: Path, column: str) -> Any:
    """``_read_table``, its file named in one line when pyarrow cannot read it (not Parquet or Arrow, truncated,
    a schema nested past pyarrow's limit)."""
    import pyarrow as pa

    try:
        return _read_table(path, column)
    except (pa.ArrowException, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise ValueError(f"{path}: unreadable as {path.suffix[1:]}: {str(error).splitlines()[0]}") from None


def _read_table(path: Path, column: str) -> Any:
    import pyarrow as pa

    if path.suffix == ".parquet":
        return _mapped_parquet(path, column)
    # .arrow files of a saved Hugging Face dataset (IPC stream, or IPC file), memory-mapped
    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(source).read_all()
    return table.select(_columns(path, table.column_names, column))


def _dataset_files(directory: Path) -> list[Path]:
    if (directory / "dataset_dict.json").is_file():
        if not (directory / "train").is_dir():
            raise FileNotFoundError(f"{directory}: dataset_dict.json without a 'train' split directory")
        directory = directory / "train"
    state = directory / "state.json"
    if state.is_file():
        from openrecipes.utils import path_inside

        try:
            names = [entry["filename"] for entry in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
            if not all(isinstance(name, str) for name in names):
                raise TypeError("a filename that is not a string")
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as error:  # JSON errors are ValueErrors
            raise ValueError(f"{state}: not a saved dataset's state (_data_files: a list of {{\"filename\": ...}}): "
                             f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
        return [path_inside(directory, name, source=state, key="_data_files[].filename") for name in names]
    files = sorted(p for p in directory.rglob("*") if p.suffix in (".jsonl", ".parquet", ".arrow")
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    if not files:
        raise FileNotFoundError(f"{directory}: no .jsonl, .parquet or .arrow files")
    return files


@dataclass(kw_only=True)
class ConversationSource:
    """All records (conversations or text documents) of an input, addressable by a global index."""

    description: str
    files: list[_File] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(f.count for f in self.files)

    def where(self, index: int) -> str:
        for f in self.files:
            if index < f.count:
                return f.where(index)
            index -= f.count
        raise IndexError(index)

    def iter_records(self, indices: np.ndarray) -> Iterator[tuple[int, Any]]:
        """(global index, raw record) at ``indices``, in that order, one record in memory at a time."""
        starts = np.cumsum([0] + [f.count for f in self.files])
        handles: dict[int, Any] = {}
        try:
            for index in indices.tolist():
                number = int(np.searchsorted(starts, index, side="right")) - 1
                f, local = self.files[number], index - int(starts[number])
                if f.kind in ("jsonl", "array"):
                    if number not in handles:
                        handles[number] = open(f.path, "rb") if f.kind == "jsonl" else f.spill
                    handles[number].seek(int(f.line_offsets[local]))
                    yield index, json.loads(handles[number].readline())
                else:
                    yield index, _drop_nulls(f.table.slice(local, 1).to_pylist()[0])
        finally:
            for number, handle in handles.items():
                if self.files[number].kind == "jsonl":  # a spill stays open: it is the records themselves
                    handle.close()


def open_source(path: str | Path, column: str = "messages") -> tuple[ConversationSource,
                                                                    Iterator[tuple[int, str, Any]]]:
    """Open an input whose tables hold ``column``; return it and an iterator over (global index, where, record).

    The source knows its files only once the iterator is exhausted."""
    path = Path(path)
    if path.is_dir():
        files = _dataset_files(path)
        description = f"Hugging Face dataset directory {path} ({len(files)} file(s))"
    elif path.is_file():
        if path.suffix not in (".jsonl", ".json", ".parquet", ".arrow"):
            raise ValueError(f"{path}: unsupported input (expected .jsonl, .json, .parquet, .arrow or a dataset "
                             "directory)")
        files, description = [path], f"{path.suffix.lstrip('.')} file {path}"
    elif path.exists():
        files = [path]
    else:
        raise FileNotFoundError(f"input {path} not found")
    for file_path in files:  # a FIFO would block the scan, a device never end
        if file_path.exists() and not file_path.is_file():
            raise ValueError(f"{file_path}: not a regular file (a FIFO, socket, device or directory); inputs are read "
                             "from files")
    source = ConversationSource(description=description)

    def scan() -> Iterator[tuple[int, str, Any]]:
        base = 0
        for file_path in files:
            if file_path.suffix in (".jsonl", ".json"):
                array = file_path.suffix == ".json" and _is_json_array(file_path)
                f = _File(path=file_path, kind="array" if array else "jsonl")
                for local, (where, record) in enumerate((_json_array if array else _json_lines)(file_path, f)):
                    yield base + local, where, record
            else:
                table = _table_or_error(file_path, column)
                f = _File(path=file_path, kind="table", count=table.num_rows, table=table)
                for start in range(0, table.num_rows, _SCAN_BATCH):
                    for local, record in enumerate(_drop_nulls(table.slice(start, _SCAN_BATCH).to_pylist()),
                                               start=start):
                        yield base + local, f.where(local), record
            source.files.append(f)
            base += f.count

    return source, scan()


def _text_field(message: dict[str, Any], key: str, where: str, position: int) -> str:
    value = message.get(key)
    if not isinstance(value, str):
        raise InvalidConversation(f"{where}: message {position}: {key!r} must be a string, "
                                  f"got {type(value).__name__}", "bad field")
    return value


def find_token(value: Any, path: str, forbidden: re.Pattern[str]) -> tuple[str, str] | None:
    """(where, token) of the first match of ``forbidden`` (the tokenizer's added tokens) in any string of ``value``
    (nested keys and values alike), or None.

    Every string can reach the rendered text: a tool name or an argument holding ``<|im_end|>`` would close the turn
    and open a forged one, a user turn holding ``<tool_response>`` would forge a tool's result. The strings
    themselves are searched (a serialization would escape a token holding a quote or a newline). Iterative, so deep
    nesting cannot exhaust the stack."""
    stack = [(value, path)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            if hit := forbidden.search(item):
                return at, hit.group(0)
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                stack.append((child, f"{at}.{key}" if at else str(key)))
                stack.append((key, f"{at} key" if at else "key"))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{at}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def _marker_in_message(message: dict[str, Any], markers: Markers) -> tuple[str, str] | None:
    """(field, token) of the first added token a field of ``message`` may not carry as a token, or None."""
    for key, value in message.items():
        pattern = markers.for_field(message.get("role"), key)
        if pattern is not None and (hit := find_token(value, key, pattern)):
            return hit
    return None


def find_marker(messages: list[dict[str, Any]], tools: Any, markers: Markers) -> tuple[str, str] | None:
    """(where, token) of the first added token a field of the conversation may not carry as a token
    (``Markers.for_field``: a reply's own reasoning and tool-call markers may), or None."""
    for position, message in enumerate(messages, start=1):
        if hit := _marker_in_message(message, markers):
            return f"message {position}: {hit[0]}", hit[1]
    return find_token(tools, "tools", markers.anywhere) if tools is not None else None


def _looks_like(record: dict[str, Any], column: str, keys: tuple[str, str]) -> bool:
    turns = record.get(column)
    return isinstance(turns, list) and bool(turns) and all(isinstance(t, dict) and set(keys) <= t.keys()
                                                           for t in turns)


def _shape_hint(record: Any, options: ChatInput) -> str:
    """What to pass when a record lacks the conversation key but has the other shape's (``ChatInput.shape``)."""
    if not isinstance(record, dict) or options.messages_field is not None:
        return ""
    if options.shape == "openai" and _looks_like(record, "conversations", ("from", "value")):
        return ("; it looks like ShareGPT (a 'conversations' list of from/value turns): pass --input-shape "
                "sharegpt (data.build.input_shape in a recipe)")
    if options.shape == "sharegpt" and _looks_like(record, "messages", ("role", "content")):
        return "; it looks like OpenAI messages (a 'messages' list of role/content turns): drop --input-shape sharegpt"
    if not record:
        return ""
    return f" (its keys: {', '.join(map(one_line, list(record)[:8]))}; --messages-field names another)"


def normalize(record: Any, where: str, forbidden: Markers | None,
              options: ChatInput | None = None) -> tuple[list[dict[str, Any]], Any]:
    """Check one record; return (messages, tools) or raise InvalidConversation naming ``where`` and its reason.

    ``options`` say how the record is read (chat_input.py); ``forbidden`` (the tokenizer's added tokens, special or
    not, ``Markers``) refuses a conversation quoting one where its field may not carry it only when
    ``options.special_tokens`` is ``refuse``: by default such a token is text.
    Keys whose value is null are dropped (Parquet fills absent struct fields with nulls).
    An assistant message with tool calls may have null content; it becomes "".
    """
    options = options or ChatInput()
    refuse = forbidden if options.special_tokens == "refuse" else None
    column = options.column
    if not isinstance(record, dict) or not isinstance(record.get(column), list):
        raise InvalidConversation(f"{where}: expected an object with a {column!r} list{_shape_hint(record, options)}",
                                  "not a conversation")
    metadata = record.get("metadata")
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata) if metadata else None
        except json.JSONDecodeError:
            raise InvalidConversation(f"{where}: 'metadata' is a string but not JSON", "bad field") from None
    tools = (metadata or {}).get("tools") if isinstance(metadata, dict) else None
    tools = tools if tools is not None else record.get("tools")
    messages = []
    for position, raw in enumerate(record[column], start=1):
        if not isinstance(raw, dict):
            raise InvalidConversation(f"{where}: message {position} is not an object", "bad field")
        message = shape_message({k: v for k, v in raw.items() if v is not None}, options,
                                f"{where}: message {position}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidConversation(f"{where}: message {position}: unknown role {role!r} "
                                      f"(expected one of {', '.join(ROLES)}; --role-map renames roles)",
                                      "unknown role")
        calls = message.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise InvalidConversation(f"{where}: message {position}: 'tool_calls' must be a list of objects, got "
                                      f"{type(calls).__name__}", "bad field")
        if role == "assistant" and calls and "content" not in message:
            message["content"] = ""
        for key in ("content", "reasoning_content"):
            if key == "content" or key in message:
                _text_field(message, key, where, position)
        # every field, not only the text: tool_calls names and arguments, name, tool_call_id
        if refuse is not None and (forged := _marker_in_message(message, refuse)):
            raise InvalidConversation(f"{where}: message {position}: {forged[0]} contains the added token "
                                      f"{forged[1]!r} (--special-tokens-in-text refuse)", "special token")
        if role == "system" and position != 1:
            raise InvalidConversation(f"{where}: message {position}: a system message is only allowed first",
                                      "system not first")
        messages.append(message)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InvalidConversation(f"{where}: 'tools' must be a list of objects, got {type(tools).__name__}",
                                  "bad field")
    if refuse is not None and tools is not None and (forged := find_token(tools, "tools", refuse.anywhere)):
        raise InvalidConversation(f"{where}: {forged[0]} contains the added token {forged[1]!r} "
                                  "(--special-tokens-in-text refuse)", "special token")
    if not messages:
        raise InvalidConversation(f"{where}: empty conversation (no messages)", "empty conversation")
    if not any(m["role"] == "assistant" for m in messages):
        raise InvalidConversation(f"{where}: no assistant turn, so nothing to supervise", "no assistant turn")
    # a lone surrogate (from a "\\udc80" escape) is not text: no tokenizer can read it. Searched for in place:
    # encoding a 50 MB conversation to find one would copy it twice
    if bad := find_token([messages, tools], "", LONE_SURROGATE):
        raise InvalidConversation(f"{where}: text holds {bad[1]!r}, which is not valid Unicode (a lone surrogate)",
                                  "invalid unicode")
    return messages, tools
