"""What a resume may change: performance-only fields and ``steps``; anything else that changes the numbers of the run
is refused by name before any work. Changes that are allowed are recorded in the run directory."""

from __future__ import annotations

import json
from pathlib import Path

from openrecipes.config.numerics import compare_recipes
from openrecipes.config.recipe import Recipe, dump_recipe, load_recipe
from openrecipes.config.rundir import RECIPE_FILE, RESUMES_FILE
from openrecipes.utils import atomic_write_text

# more steps train further: the schedule's length changes from the resumed step on, and the run directory says so
ALLOWED_NUMERICS = ("steps",)


def resumed_changes(run_dir: Path, recipe: Recipe) -> dict[str, list]:
    """The fields ``recipe`` changes against the run's recorded recipe, as {path: [before, after]}.

    Raises ValueError naming every numerics field that changed (the run would no longer be the one its
    checkpoints and metrics belong to)."""
    stored = load_recipe(Path(run_dir) / RECIPE_FILE)
    report = compare_recipes(recipe, stored, candidate_name="resumed", reference_name="recorded")
    refused = [d for d in report.numerics if d.path not in ALLOWED_NUMERICS]
    if refused:
        listed = "; ".join(f"{d.path}: {d.reference!r} -> {d.candidate!r}" for d in refused)
        raise ValueError(f"--resume {run_dir}: these fields change what the run computes and may not change on "
                         f"resume: {listed} (start a new run instead; performance-only fields and steps may change)")
    return {d.path: [d.reference, d.candidate] for d in report.numerics + report.performance
            if d.path != "run_dir"}


def record_resume(run_dir: Path, recipe: Recipe, changes: dict[str, list], step: int) -> None:
    """Append the resume to ``resumes.jsonl`` and make ``recipe.yaml`` the recipe as resumed."""
    if not changes:
        return
    path = Path(run_dir) / RESUMES_FILE
    previous = path.read_text() if path.is_file() else ""
    atomic_write_text(path, previous + json.dumps({"step": step, "changes": changes}) + "\n")
    atomic_write_text(Path(run_dir) / RECIPE_FILE, dump_recipe(recipe))
