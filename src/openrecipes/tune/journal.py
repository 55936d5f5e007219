"""The tuner's output directory: ``trials.jsonl`` (one record per finished trial), ``pruned.jsonl`` and
``tune.json`` (what the trials were measured under, so a rerun reuses them only when that is unchanged, and, once
the search has ended, under ``result`` the figures the console, the card and the site quote) and
``calibration.json`` (the refit, which a later tuning of the same model family starts from).

``trials.jsonl`` is rewritten whole through a temporary file and a rename after every trial, so a kill leaves the
previous complete file, never a half-written line. A trial's run directory is only ever taken as a result through
its record: a directory without one (a trial killed mid-run) is deleted and the trial runs again.

A record is typed (``TrialRecord``) and bound: to the start it was measured for (``measured_under``, the sha256 of
the start's resolved recipe, target, steps, window and rows) and, when it measured something, to its run
(``run_sha256`` of the run's ``metrics.jsonl``, from which its figures are recomputed on reading). A journal
copied from another start, a record edited by hand or a run changed under it is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from openrecipes.cards.schema import TrialFailure
from openrecipes.config.rundir import METRICS_FILE
from openrecipes.utils import atomic_write_text, iter_json_lines, path_inside, read_json

TRIALS_FILE = "trials.jsonl"
PRUNED_FILE = "pruned.jsonl"
SETTINGS_FILE = "tune.json"
CALIBRATION_FILE = "calibration.json"  # the refit of this run, for later runs of the family (family_calibration.py)
RESULT_KEY = "result"  # tune.json's figures of the finished search; not a setting
TRIALS_DIR = "trials"
MARKER = ".openrecipes-tune"

FAILURE_CLASSES = get_args(TrialFailure)  # the card's vocabulary: a journal's failure lands on a card
PHASES = ("start", "given", "ranked", "around-best", "remeasure", "ablation")
SEARCH_PHASES = PHASES[:4]  # the trials --trials counts; a remeasured or ablated run comes after the search
# measured figures recomputed from the run must equal the record's to this relative difference (JSON round trips)
FIGURE_TOLERANCE = 1e-9


class TrialFailure(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    failure_class: Literal[FAILURE_CLASSES] = Field(alias="class")
    detail: str


class TrialMeasurement(BaseModel):
    """``openrecipes measure``'s figures over the trial's window, and the run's final loss."""

    model_config = ConfigDict(extra="forbid")
    tokens_per_s_per_gpu: float = Field(gt=0)
    step_time_mean_s: float = Field(gt=0)
    step_time_cv: float = Field(ge=0)
    peak_memory_gib: float | None = Field(default=None, ge=0)
    peak_reserved_gib: float | None = Field(default=None, ge=0)  # the allocator's peak (tune/predict.py refits it)
    gpu_type: str
    gpus: int = Field(ge=1)
    final_loss: float
    window: tuple[int, int]  # the steps measured: the tuning's window, or its first steps once they were stable

    @field_validator("tokens_per_s_per_gpu", "step_time_mean_s", "step_time_cv", "final_loss")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class TrialRecord(BaseModel):
    """One line of ``trials.jsonl``."""

    model_config = ConfigDict(extra="forbid")
    index: int = Field(ge=0)
    key: str = Field(min_length=1)
    phase: Literal[PHASES]
    changes: dict[str, Any]
    label: str
    layout: str
    prediction: dict[str, Any] | None
    status: Literal["ok", "failed"]
    failure: TrialFailure | None
    measured: TrialMeasurement | None
    wall_s: float = Field(ge=0)
    overhead_s: float | None = Field(default=None, ge=0)
    startup_s: dict[str, float] | None = None
    run_dir: str
    finished: str
    measured_under: str = Field(pattern=r"^[0-9a-f]{64}$")
    run_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _status_agrees(self) -> "TrialRecord":
        if self.status == "ok" and (self.measured is None or self.failure is not None or self.run_sha256 is None):
            raise ValueError("status ok needs measured and run_sha256 and no failure")
        if self.status == "failed" and (self.failure is None or self.measured is not None):
            raise ValueError("status failed needs a failure and no measurement")
        return self


def run_sha256(run_dir: Path) -> str | None:
    """The sha256 of a run's metrics.jsonl (what its measurement was computed from), or None without one."""
    try:
        return hashlib.sha256((run_dir / METRICS_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def settings_sha256(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _first_error(error: ValidationError) -> str:
    item = error.errors()[0]
    where = ".".join(str(part) for part in item["loc"]) or "record"
    return f"{where}: {item['msg']}"


class Journal:
    """The trials recorded in ``out`` for the start ``measured_under`` names; each record's window recomputes its
    figures."""

    def __init__(self, out: Path, *, measured_under: str) -> None:
        self.out, self.measured_under = out, measured_under
        self.path = out / TRIALS_FILE
        self.records: list[dict[str, Any]] = []
        if self.path.exists():
            for line, record in iter_json_lines(self.path):
                self.records.append(self._checked(record, f"{self.path}:{line}"))

    def _checked(self, record: Any, where: str) -> dict[str, Any]:
        try:
            typed = TrialRecord.model_validate(record)
        except ValidationError as error:
            raise ValueError(f"{where}: not a trial record of this openrecipes tune ({_first_error(error)}); "
                             "choose another --out") from None
        if typed.measured_under != self.measured_under:
            raise ValueError(f"{where}: trial {typed.key} was measured for another start, target, window or rows "
                             f"(measured_under {typed.measured_under[:12]}, this tuning "
                             f"{self.measured_under[:12]}); choose another --out")
        # joined to ``out`` wherever the trial's run is read (measure, verify, the card): it must stay there
        run_dir = path_inside(self.out, typed.run_dir, source=where, key="run_dir")
        if typed.status == "ok":
            self._check_run(typed, run_dir, where)
        return record

    def _check_run(self, typed: TrialRecord, run_dir: Path, where: str) -> None:
        from openrecipes.tune.runner import measure_trial

        if run_sha256(run_dir) != typed.run_sha256:
            raise ValueError(f"{where}: trial {typed.key}'s run {run_dir / METRICS_FILE} is missing or changed since "
                             "it was measured (run_sha256 differs); choose another --out")
        again = measure_trial(run_dir, typed.measured.window)
        for name, recorded in typed.measured.model_dump().items():
            value = again.get(name)
            same = (recorded == value if not isinstance(recorded, float) or not isinstance(value, (int, float))
                    else math.isclose(recorded, value, rel_tol=FIGURE_TOLERANCE))
            if not same:
                raise ValueError(f"{where}: trial {typed.key}: measured.{name} is {recorded!r} but its run gives "
                                 f"{value!r}: the record was edited; choose another --out")

    def find(self, key: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r["key"] == key), None)

    def append(self, record: dict[str, Any]) -> None:
        if self.find(record["key"]) is not None:
            raise AssertionError(f"trial {record['key']} is already recorded")
        TrialRecord.model_validate(record)  # what is written can be read back
        self.records.append(record)
        atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records))

    def trial_dir(self, index: int, key: str) -> Path:
        return self.out / TRIALS_DIR / f"{index:03d}-{key}"

    def fresh_trial_dir(self, index: int, key: str) -> Path:
        """An empty directory for a trial: anything there is a trial killed before its record was written. One
        still running (its launcher holds the run directory) is never deleted nor started again beside it."""
        from openrecipes.train.run_lock import live_holder

        path = self.trial_dir(index, key)
        holder = live_holder(path / "run")
        if holder is not None:
            raise ValueError(f"{path / 'run'}: trial {key} is still running as process {holder['pid']} "
                             f"({holder.get('command', '?')}); stop it or wait for it, then rerun")
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path


def write_pruned(out: Path, pruned: list[dict[str, Any]]) -> None:
    atomic_write_text(out / PRUNED_FILE, "".join(json.dumps(p, sort_keys=True) + "\n" for p in pruned))


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Record what the trials are measured under; refuse to mix trials measured under other settings."""
    path = out / SETTINGS_FILE
    if path.exists():
        before = {k: v for k, v in read_json(path).items() if k != RESULT_KEY}
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            raise ValueError(f"{path}: the trials in {out} were measured with other settings ({', '.join(changed)} "
                             "differ); rerun with the same command, or choose another --out")
        return
    atomic_write_text(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def record_result(out: Path, result: dict[str, Any]) -> None:
    """Write the finished search's figures into ``tune.json`` beside its settings (replacing an earlier run's)."""
    path = out / SETTINGS_FILE
    settings = read_json(path) if path.exists() else {}
    atomic_write_text(path, json.dumps({**settings, RESULT_KEY: result}, indent=2, sort_keys=True) + "\n")


def prepare_out(out: Path, start_path: Path) -> None:
    """Create ``out`` or reuse one an earlier ``openrecipes tune`` wrote (it carries MARKER). A marked directory
    is held to the same rules as a new one (not a link, not the working directory or above it, apart from the
    start recipe): a marker file does not make any directory one the tuner may fill."""
    from openrecipes.utils import check_output_dir

    check_output_dir(out, marker=MARKER, writer="openrecipes tune", overwrite=(out / MARKER).is_file(),
                     inputs=[start_path], reused=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by openrecipes tune; rerunning the same command reuses its trials\n")
