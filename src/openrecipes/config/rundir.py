"""The run directory (docs/run-dir.md): its file names, the typed ``run.json`` record and the ``metrics.jsonl`` reader.

``train`` writes what is named here; ``measure``, ``card new`` and ``verify`` read it through these functions.
Errors name the file and, for metrics, the line, so a broken run is easy to find.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openrecipes.utils import (atomic_write_text, check_apart_from_inputs, iter_json_lines,
                               nearest_existing_parent, read_json)

RECIPE_FILE = "recipe.yaml"       # the resolved recipe the run trains
RUN_FILE = "run.json"             # RunInfo: what ran, where, with which versions
METRICS_FILE = "metrics.jsonl"    # one JSON line per step
CHECKPOINTS_DIR = "checkpoints"   # step-NNNNNN directories and the `latest` pointer (checkpoint/training_save.py)
ADAPTER_DIR = "adapter"           # a LoRA run's PEFT adapter, written after its last step
ROWS_DIR = "rows"                 # rows built at the start of the run (data.build)
PROFILE_FILE = "profile.txt"      # the kernel table of a profiled step (debug.profile_step)
PROFILE_TRACE_FILE = "profile_trace.json"  # its Chrome trace (debug.profile_timeline): where the GPU waits
LOCK_FILE = ".openrecipes-run.lock"  # held by the launcher while a job runs (pid, host, command)
RESUMES_FILE = "resumes.jsonl"    # each resume that changed the recipe: the step it took effect and the changes
INPUTS_FILE = "inputs.json"       # what a fresh start read: sha256 of rows, base config.json, resolved recipe
# a LoRA run of a registry model: its frozen base as a Hugging Face directory, which the adapter names, so PEFT
# loads base and adapter from the adapter alone (an HF base directory is named as it is)
BASE_EXPORT_DIR = "base"
HF_EXPORT_DIR = "hf"              # the last save as a Hugging Face directory (checkpoint.export_hf)
STARTUP_FILE = "startup.json"     # seconds of each phase before the first step finished (train/startup.py)
RUN_MARKER = ".openrecipes-run"   # written when train takes a directory: a populated one without it is not trained into
# marks an output directory as a data build's (a run's rows among them), so --overwrite may replace it, nothing else
DATA_MARKER = ".openrecipes-data"


# a save's directory inside CHECKPOINTS_DIR: the step it holds (0-based), six digits or more
STEP_DIR = re.compile(r"step-\d{6,}")
STEP_DIR_GLOB = "step-*"


def checkpoint_name(step: int) -> str:
    """The directory name of the save of ``step`` (0-based) inside CHECKPOINTS_DIR."""
    return f"step-{step:06d}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step a save directory (named by ``checkpoint_name``) holds."""
    return int(Path(path).name.removeprefix("step-"))


def rows_directory(data_rows: str | None, run_dir: str | os.PathLike) -> Path:
    """The rows a run trains on: the recipe's ``data.rows``, or those built into the run directory."""
    return Path(data_rows) if data_rows is not None else Path(run_dir) / ROWS_DIR


# what every run.json train has written holds: a user's own run.json beside a recipe.yaml is no run of train's
_TRAIN_RUN_FILE_KEYS = ("command", "started", "world_size", "versions")


def is_run_directory(path: str | os.PathLike) -> bool:
    """Whether ``train`` made ``path``: it holds RUN_MARKER or, for a run from before the marker, recipe.yaml beside
    a run.json as train writes it (a user's own recipe.yaml and run.json are not enough)."""
    path = Path(path)
    if (path / RUN_MARKER).is_file():
        return True
    if not ((path / RUN_FILE).is_file() and (path / RECIPE_FILE).is_file()):
        return False
    try:
        written = read_json(path / RUN_FILE)
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and all(key in written for key in _TRAIN_RUN_FILE_KEYS)


def _built_rows(path: Path) -> bool:
    """``path`` is the rows folder a build made for the run beforehand (empty, or marked by ``data build``)."""
    return path.name == ROWS_DIR and path.is_dir() and (not any(path.iterdir()) or (path / DATA_MARKER).is_file())


def claim_run_dir(run_dir: str | os.PathLike, inputs: list[str | os.PathLike | None]) -> Path:
    """Create (or take again) the run directory and mark it, before anything is written into it; returns it.

    A run needs an absent or empty directory, or one ``train`` made (``is_run_directory``); rows built for the run
    beforehand (``ROWS_DIR``, what ``train`` writes first) do not count as content. Refused, each in one line
    naming ``run_dir``: a parent of the working directory (``..``, ``/``), a file, a populated directory that is no
    run directory, and a directory that is, holds or sits inside one of the run's ``inputs`` (its recipe file, model,
    rows and build inputs)."""
    target = Path(run_dir)
    if target.resolve() in Path.cwd().resolve().parents:
        raise ValueError(f"run_dir: {run_dir} holds the working directory; name a directory for the run")
    check_apart_from_inputs(target, inputs, option="run_dir")
    if target.exists() and not target.is_dir():
        raise ValueError(f"run_dir: {run_dir} exists and is not a directory")
    above = nearest_existing_parent(target)
    if above is not None and not above.is_dir():
        raise ValueError(f"run_dir: {run_dir} lies under {above}, which is a file, not a directory")
    if target.is_dir() and any(not _built_rows(p) for p in target.iterdir()) and not is_run_directory(target):
        raise ValueError(f"run_dir: {run_dir} is not empty and is not a run directory (it has no {RUN_MARKER}); "
                         "choose a new or empty directory")
    target.mkdir(parents=True, exist_ok=True)
    if not (target / RUN_MARKER).is_file():
        atomic_write_text(target / RUN_MARKER, "written by openrecipes train: a run directory, trained into again "
                                               "only by train and train --resume\n")
    return target


# strict JSON has no NaN or infinity: metrics.jsonl writes them as these strings, and readers take them back as floats
NONFINITE_TEXT = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}

# with layout.pp > 1: a list, stage 0 first, of the largest peak (GiB) over the ranks of each pipeline stage
PEAK_MEMORY_PER_STAGE = "peak_memory_gib_per_stage"


def encode_metric(value: Any) -> Any:
    """A metrics.jsonl value: non-finite floats as "nan", "inf" or "-inf", visible and valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return value


def decode_metric(value: Any) -> Any:
    """The inverse of ``encode_metric``: the non-finite strings back as floats, anything else as it is."""
    return NONFINITE_TEXT.get(value, value) if isinstance(value, str) else value


class RunModelInfo(BaseModel):
    """The model's shape as measure needs it (MFU and attention FLOPs)."""

    model_config = ConfigDict(extra="allow", strict=True)  # JSON numbers as written: no "8" or true for 8
    name: str | None = None
    active_params: int | None = Field(None, ge=1)
    total_params: int | None = Field(None, ge=1)
    num_layers: int | None = Field(None, ge=1)
    hidden_size: int | None = Field(None, ge=1)
    num_attention_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)


class RunGpuInfo(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # JSON numbers as written: no "8" or true for 8
    type: str
    count: int = Field(..., ge=1)


class RunInfo(BaseModel):
    """``run.json``. Fields a reader cannot do without are required; the rest are optional so that run
    directories written by other tools (or older versions) still measure."""

    model_config = ConfigDict(extra="allow", strict=True)  # JSON numbers as written: no "8" or true for 8
    command: str | None = None
    started: str | None = None               # ISO-8601 UTC
    model: RunModelInfo = Field(default_factory=RunModelInfo)
    gpu: RunGpuInfo
    world_size: int | None = Field(None, ge=1)
    global_batch: int | None = Field(None, ge=1)
    row_tokens: int | None = Field(None, ge=1)
    rows_per_microbatch: int | None = Field(None, ge=1)  # what the loop ran (layout x row length)
    steps: int | None = Field(None, ge=1)
    versions: dict[str, str | None] = Field(default_factory=dict)

    def require(self, dotted: str, origin: str | os.PathLike) -> Any:
        """The value at ``a.b``, or a ValueError naming the file and the field when it is absent."""
        node: Any = self
        for part in dotted.split("."):
            node = getattr(node, part, None)
            if node is None:
                raise ValueError(f"{origin}: missing field '{dotted}'")
        return node


def write_run_info(run_dir: str | os.PathLike, info: RunInfo) -> None:
    atomic_write_text(Path(run_dir) / RUN_FILE, info.model_dump_json(indent=2, exclude_none=True) + "\n")


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One line of metrics.jsonl: the step number, the line it came from, and all its fields."""

    step: int
    line: int
    fields: dict[str, Any]


def read_run_info(run_dir: str | os.PathLike) -> RunInfo:
    path = Path(run_dir) / RUN_FILE
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"run directory {run_dir} not found")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is {run_dir} a run directory?)")
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    try:
        return RunInfo.model_validate(data)
    except ValidationError as error:
        item = error.errors()[0]
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        raise ValueError(f"{path}: {where}: {item['msg']}") from None


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
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ValueError(f"{path}:{record.line}: step {record.step}: field '{key}' is too large a number") from None


def stage_peaks(record: StepRecord, path: str | os.PathLike) -> list[float] | None:
    """The record's peak memory per pipeline stage (``PEAK_MEMORY_PER_STAGE``), or None when it has none; a value
    that is not a list of non-negative numbers is a ValueError naming file, line and field."""
    value = record.fields.get(PEAK_MEMORY_PER_STAGE)
    if value is None:
        return None
    if not isinstance(value, list) or not value or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 for v in value):
        raise ValueError(f"{path}:{record.line}: step {record.step}: field '{PEAK_MEMORY_PER_STAGE}' must be a "
                         f"non-empty list of non-negative numbers, got {value!r}")
    return [float(v) for v in value]


def read_startup(run_dir: str | os.PathLike) -> dict[str, float] | None:
    """The start-up phases of a run's ``startup.json`` (seconds each, train/startup.py), or None when it has none
    (a run killed before its first step) or it is not such a record."""
    try:
        phases = read_json(Path(run_dir) / STARTUP_FILE).get("phases_s")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(phases, dict):
        return None
    return {str(k): float(v) for k, v in phases.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
