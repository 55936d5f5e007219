"""The tuner's output directory: ``trials.jsonl`` (one record per finished trial), ``pruned.jsonl`` and
``tune.json`` (what the trials were measured under, so a rerun reuses them only when that is unchanged).

``trials.jsonl`` is rewritten whole through a temporary file and a rename after every trial, so a kill leaves the
previous complete file, never a half-written line. A trial's run directory is only ever taken as a result through
its record: a directory without one (a trial killed mid-run) is deleted and the trial runs again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from openrecipes.utils import atomic_write_text, iter_json_lines, path_inside, read_json

TRIALS_FILE = "trials.jsonl"
PRUNED_FILE = "pruned.jsonl"
SETTINGS_FILE = "tune.json"
TRIALS_DIR = "trials"
MARKER = ".openrecipes-tune"

FAILURE_CLASSES = ("out_of_memory", "timeout", "crash", "non_finite_loss", "refused_layout")


class Journal:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out / TRIALS_FILE
        self.records: list[dict[str, Any]] = []
        if self.path.exists():
            for line, record in iter_json_lines(self.path):
                if not isinstance(record.get("key"), str) or record.get("status") not in ("ok", "failed"):
                    raise ValueError(f"{self.path}:{line}: not a trial record of openrecipes tune")
                # joined to ``out`` wherever the trial's run is read (measure, verify, the card): it must stay there
                path_inside(out, record.get("run_dir"), source=f"{self.path}:{line}", key="run_dir")
                self.records.append(record)

    def find(self, key: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r["key"] == key), None)

    def append(self, record: dict[str, Any]) -> None:
        if self.find(record["key"]) is not None:
            raise AssertionError(f"trial {record['key']} is already recorded")
        self.records.append(record)
        atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records))

    def trial_dir(self, index: int, key: str) -> Path:
        return self.out / TRIALS_DIR / f"{index:03d}-{key}"

    def fresh_trial_dir(self, index: int, key: str) -> Path:
        """An empty directory for a trial: anything there is a trial killed before its record was written."""
        path = self.trial_dir(index, key)
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
        before = read_json(path)
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            raise ValueError(f"{path}: the trials in {out} were measured with other settings ({', '.join(changed)} "
                             "differ); rerun with the same command, or choose another --out")
        return
    atomic_write_text(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def prepare_out(out: Path, start_path: Path) -> None:
    """Create ``out`` or reuse one an earlier ``openrecipes tune`` wrote (it carries MARKER)."""
    from openrecipes.utils import check_output_dir

    if not (out / MARKER).is_file():
        check_output_dir(out, marker=MARKER, writer="openrecipes tune", overwrite=False, inputs=[start_path])
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by openrecipes tune; rerunning the same command reuses its trials\n")
