"""Loss curves from a run directory or a loss file.

Accepted inputs:

* a run directory: the ``loss`` field of each line of its ``metrics.jsonl``;
* JSON Lines: one ``{"step": int, "loss": number}`` object per line;
* CSV: a header naming ``step`` and ``loss`` columns (others are ignored), one row per step.

A loss written as ``null`` (JSON) or an empty cell (CSV) is kept as "no value" and NaN or
infinity as themselves: they are findings of the convergence check, not input errors.
Malformed lines, non-integer steps and repeated steps are input errors naming file and line.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

from openrecipes.config.rundir import METRICS_FILE, decode_metric, read_metrics
from openrecipes.utils import iter_json_lines, utf8_problem


@dataclass(frozen=True, kw_only=True)
class LossCurve:
    """Loss per step; ``None`` marks a step recorded without a value."""

    source: str
    losses: dict[int, float | None]

    def steps(self) -> list[int]:
        return sorted(self.losses)


def _parse_step(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{where}: 'step' must be a non-negative integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{where}: 'step' must be a non-negative integer, got {value!r}") from None
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: 'step' must be a non-negative integer, got {value!r}")
    return value


def _json_loss(value: object, where: str) -> float | None:
    value = decode_metric(value)  # the trainer writes a non-finite loss as "nan" / "inf": a failing step, not bad input
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: 'loss' must be a number or null, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ValueError(f"{where}: 'loss' is too large a number") from None


def _add(losses: dict[int, float | None], lines: dict[int, int], step: int, loss: float | None,
         path: Path, line_no: int) -> None:
    if step in losses:
        raise ValueError(f"{path}:{line_no}: step {step} repeats line {lines[step]}")
    losses[step] = loss
    lines[step] = line_no


def read_jsonl_curve(path: Path) -> LossCurve:
    losses: dict[int, float | None] = {}
    lines: dict[int, int] = {}
    for line_no, data in iter_json_lines(path):
        where = f"{path}:{line_no}"
        for key in ("step", "loss"):
            if key not in data:
                raise ValueError(f"{where}: missing field '{key}'")
        _add(losses, lines, _parse_step(data["step"], where), _json_loss(data["loss"], where), path, line_no)
    return LossCurve(source=str(path), losses=losses)


def read_csv_curve(path: Path) -> LossCurve:
    """A step,loss CSV file; a file the csv module or UTF-8 cannot read is one line naming it."""
    try:
        return _read_csv_curve(path)
    except csv.Error as error:  # a field over the csv module's size limit, a NUL in older Pythons
        raise ValueError(f"{path}: unreadable CSV ({error})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: {utf8_problem(error)}") from None


def _read_csv_curve(path: Path) -> LossCurve:
    losses: dict[int, float | None] = {}
    lines: dict[int, int] = {}
    with open(path, newline="") as handle:
        reader = csv.reader(handle)
        header: list[str] | None = None
        for row in reader:
            line_no = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if header is None:
                header = [cell.strip().lower() for cell in row]
                for key in ("step", "loss"):
                    if key not in header:
                        raise ValueError(f"{path}:{line_no}: CSV header must name a '{key}' column, got {row}")
                step_col, loss_col = header.index("step"), header.index("loss")
                continue
            where = f"{path}:{line_no}"
            if len(row) != len(header):
                raise ValueError(f"{where}: expected {len(header)} columns, got {len(row)}")
            cell = row[loss_col].strip()
            if cell == "":
                loss = None
            else:
                try:
                    loss = float(cell)  # accepts nan / inf, which the check then reports
                except ValueError:
                    raise ValueError(f"{where}: 'loss' must be a number, got {cell!r}") from None
            _add(losses, lines, _parse_step(row[step_col], where), loss, path, line_no)
    if header is None:
        raise ValueError(f"{path}: empty CSV file (expected a 'step,loss' header)")
    return LossCurve(source=str(path), losses=losses)


def read_run_dir_curve(run_dir: Path) -> LossCurve:
    path = run_dir / METRICS_FILE
    losses: dict[int, float | None] = {}
    for record in read_metrics(path):
        if "loss" not in record.fields:
            raise ValueError(f"{path}:{record.line}: step {record.step}: missing field 'loss'")
        losses[record.step] = _json_loss(record.fields["loss"], f"{path}:{record.line}")
    return LossCurve(source=str(run_dir), losses=losses)


def _looks_like_csv(path: Path) -> bool:
    if path.suffix.lower() == ".csv":
        return True
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return False
    with open(path) as handle:
        for text in handle:
            if text.strip():
                return not text.lstrip().startswith("{")
    return False


def read_loss_curve(path: str | os.PathLike) -> LossCurve:
    """A loss curve from a run directory, a JSON Lines file or a CSV file; never empty."""
    path = Path(path)
    if path.is_dir():
        curve = read_run_dir_curve(path)
    elif path.is_file():
        curve = read_csv_curve(path) if _looks_like_csv(path) else read_jsonl_curve(path)
    else:
        raise FileNotFoundError(f"{path} not found (expected a run directory or a loss file)")
    if not curve.losses:
        raise ValueError(f"{curve.source}: no loss values")
    return curve


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
