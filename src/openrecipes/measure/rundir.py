"""Reading a run directory (docs/run-dir.md): ``run.json`` and ``metrics.jsonl``.

Errors name the file and, for metrics, the line, so a broken run is easy to find.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrecipes.utils import iter_json_lines, read_json

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One line of metrics.jsonl: the step number, the line it came from, and all its fields."""

    step: int
    line: int
    fields: dict[str, Any]


def read_run_json(run_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(run_dir) / RUN_FILE
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"run directory {run_dir} not found")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is {run_dir} a run directory?)")
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_metrics(path: str | os.PathLike) -> list[StepRecord]:
    """Every record of a metrics.jsonl file, in file order; duplicate steps are an error.

    Python's json accepts the NaN / Infinity literals that ``json.dumps`` writes for
    non-finite floats, so a diverged step is read, not rejected; checks decide what it means.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    records: list[StepRecord] = []
    seen: dict[int, int] = {}
    for line_no, data in iter_json_lines(path):
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{path}:{line_no}: 'step' must be a non-negative integer, got {step!r}")
        if step in seen:
            raise ValueError(f"{path}:{line_no}: step {step} repeats line {seen[step]}")
        seen[step] = line_no
        records.append(StepRecord(step=step, line=line_no, fields=data))
    return records


def require_number(record: StepRecord, key: str, path: str | os.PathLike, *, allow_null: bool = False) -> float | None:
    """``record.fields[key]`` as a float, or a ValueError naming file, line and field."""
    value = record.fields.get(key, None)
    if value is None:
        if allow_null:
            return None
        if key not in record.fields:
            raise ValueError(f"{path}:{record.line}: step {record.step}: missing field '{key}'")
        raise ValueError(f"{path}:{record.line}: step {record.step}: field '{key}' is null")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}:{record.line}: step {record.step}: field '{key}' must be a number, got {value!r}")
    return float(value)


def get_path(data: dict[str, Any], dotted: str, origin: str | os.PathLike) -> Any:
    """``data['a']['b']`` for ``'a.b'``, or a ValueError naming the file and the field."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{origin}: missing field '{dotted}'")
        node = node[part]
    return node
