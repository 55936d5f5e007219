"""What a resume may change: performance-only fields and ``steps``; anything else that changes the numbers of the run
is refused by name before any work. Changes that are allowed are recorded in the run directory.

A fresh start records what it read (``inputs.json``): the sha256 of its rows' parquet file, of the Hugging Face
``config.json`` of its base model (when ``model`` is a directory) and of its resolved recipe, with the recipe itself.
A resume compares against that record, not against ``RUN_DIR/recipe.yaml``, which it reads and may have been edited:
rows rebuilt in place, an edited base config and a numerics field edited in ``recipe.yaml`` are refused by name, as
``--set`` is."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from openrecipes.config.numerics import compare_recipes
from openrecipes.config.recipe import Recipe, dump_recipe, load_recipe, recipe_from_dict
from openrecipes.config.rundir import INPUTS_FILE, RECIPE_FILE, RESUMES_FILE, rows_directory
from openrecipes.data.manifest import parquet_path, read_manifest
from openrecipes.utils import atomic_write_text, read_json, sha256_file

# more steps train further: the schedule's length changes from the resumed step on, and the run directory says so
ALLOWED_NUMERICS = ("steps",)
HF_CONFIG_FILE = "config.json"  # a Hugging Face model directory's architecture: what `model` names when it is a path


def rows_sha256(rows: Path) -> str:
    """The sha256 of the rows' parquet file: the manifest's ``parquet_sha256`` (which loading the rows checks against
    the file), or the file hashed when the manifest has none."""
    manifest = read_manifest(rows)
    recorded = manifest.get("parquet_sha256")
    return recorded if isinstance(recorded, str) else sha256_file(parquet_path(rows, manifest))


def base_config_file(recipe: Recipe) -> Path | None:
    """The base model's ``config.json`` when ``model`` is a directory (a registered model name has none)."""
    from openrecipes.models.registry import names

    path = Path(recipe.model) / HF_CONFIG_FILE
    return path if recipe.model not in names() and path.is_file() else None


def _recipe_record(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as ``inputs.json`` keeps it: its sha256 (of the text ``recipe.yaml`` is written with) and
    its fields, which a resume is compared against field by field."""
    return {"sha256": hashlib.sha256(dump_recipe(recipe).encode("utf-8")).hexdigest(),
            "resolved": recipe.model_dump(mode="json")}


def run_inputs(run_dir: Path, recipe: Recipe) -> dict[str, Any]:
    """What ``inputs.json`` holds for ``recipe`` trained into ``run_dir``."""
    rows = rows_directory(recipe.data.rows, run_dir)
    record: dict[str, Any] = {"rows": {"directory": str(rows), "parquet_sha256": rows_sha256(rows)}}
    base = base_config_file(recipe)
    if base is not None:
        record["base_config"] = {"file": str(base), "sha256": sha256_file(base)}
    record["recipe"] = _recipe_record(recipe)
    return record


def record_inputs(run_dir: Path, recipe: Recipe) -> None:
    """At a fresh start: write ``inputs.json`` (what later resumes are compared against)."""
    atomic_write_text(Path(run_dir) / INPUTS_FILE, json.dumps(run_inputs(Path(run_dir), recipe), indent=2) + "\n")


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``inputs.json``, or None for a run started before runs recorded it."""
    path = Path(run_dir) / INPUTS_FILE
    if not path.is_file():
        return None
    record = read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("recipe"), dict) \
            or not isinstance(record["recipe"].get("resolved"), dict):
        raise ValueError(f"{path}: expected an object with recipe.resolved (written by openrecipes train)")
    return record


def _changed_inputs(run_dir: Path, recipe: Recipe, recorded: dict[str, Any]) -> list[str]:
    """The rows and base config that differ from those the run started with, one line each."""
    changed = []
    rows = rows_directory(recipe.data.rows, run_dir)
    before = (recorded.get("rows") or {}).get("parquet_sha256")
    if before is not None and (now := rows_sha256(rows)) != before:
        changed.append(f"rows: {rows} has parquet sha256 {now}, the run started on {before} (rebuilt or changed "
                       "in place)")
    base = base_config_file(recipe)
    before = (recorded.get("base_config") or {}).get("sha256")
    now = sha256_file(base) if base is not None else None
    if now != before:
        changed.append(f"base config: {base or Path(recipe.model) / HF_CONFIG_FILE} has sha256 {now or '(none)'}, "
                       f"the run started with {before or '(none)'}")
    return changed


def resumed_changes(run_dir: Path, recipe: Recipe) -> dict[str, list]:
    """The fields ``recipe`` changes against the recipe the run started with (``inputs.json``; ``recipe.yaml`` for a
    run from before that record), as {path: [before, after]}.

    Raises ValueError naming every numerics field that changed, and the rows or base config when their sha256 is not
    the one recorded at the start (the run would no longer be the one its checkpoints and metrics belong to)."""
    recorded = _recorded(run_dir)
    if recorded is None:
        stored, source = load_recipe(Path(run_dir) / RECIPE_FILE), RECIPE_FILE
    else:
        stored = recipe_from_dict(recorded["recipe"]["resolved"], source=f"{Path(run_dir) / INPUTS_FILE} recipe")
        source = INPUTS_FILE
    report = compare_recipes(recipe, stored, candidate_name="resumed", reference_name="recorded")
    refused = [f"{d.path}: {d.reference!r} -> {d.candidate!r}" for d in report.numerics
               if d.path not in ALLOWED_NUMERICS]
    refused += _changed_inputs(Path(run_dir), recipe, recorded) if recorded is not None else []
    if refused:
        raise ValueError(f"--resume {run_dir}: these change what the run computes and may not change on resume "
                         f"(against the run's start, {source}): {'; '.join(refused)} (start a new run instead; "
                         "performance-only fields and steps may change)")
    return {d.path: [d.reference, d.candidate] for d in report.numerics + report.performance
            if d.path != "run_dir"}


def record_resume(run_dir: Path, recipe: Recipe, changes: dict[str, list], step: int) -> None:
    """Append the resume to ``resumes.jsonl`` and make ``recipe.yaml`` (and the recipe ``inputs.json`` records) the
    recipe as resumed, so the next resume is compared against it."""
    if not changes:
        return
    run_dir = Path(run_dir)
    path = run_dir / RESUMES_FILE
    previous = path.read_text() if path.is_file() else ""
    atomic_write_text(path, previous + json.dumps({"step": step, "changes": changes}) + "\n")
    atomic_write_text(run_dir / RECIPE_FILE, dump_recipe(recipe))
    recorded = _recorded(run_dir)
    if recorded is not None:  # the rows and base config are those recorded: a resume that changed them was refused
        recorded["recipe"] = _recipe_record(recipe)
        atomic_write_text(run_dir / INPUTS_FILE, json.dumps(recorded, indent=2) + "\n")
