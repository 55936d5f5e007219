"""One trial between its start and its record: what the record of ``trials.jsonl`` holds besides the outcome, and
the record itself (``journal.TrialRecord``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrecipes.config.recipe import dump_recipe, recipe_from_dict
from openrecipes.config.rundir import read_startup
from openrecipes.tune.journal import run_sha256
from openrecipes.tune.predict import Prediction
from openrecipes.tune.runner import Outcome, TrialRun
from openrecipes.tune.space import Candidate

TRIAL_RECIPE = "recipe.yaml"  # in the trial's folder, beside its run directory


@dataclass(frozen=True, kw_only=True)
class OpenTrial:
    """A trial started (or about to be) and not yet recorded."""

    index: int
    key: str
    phase: str
    candidate: Candidate
    label: str
    prediction: Prediction | None
    calibrated: float | None  # the prediction under the refit it was ranked with
    calibrated_peak_gib: float | None  # the peak reserved memory the search expected, under that refit
    calibrated_allocated_gib: float | None  # the peak allocated memory it expected (what the trial measures)
    calibration: dict[str, Any]  # that refit
    run: TrialRun


def trial_record(opened: OpenTrial, outcome: Outcome, *, out: Path, trial_steps: int,
                 measured_under: str) -> dict[str, Any]:
    """The trial's line of ``trials.jsonl``."""
    candidate, prediction, run = opened.candidate, opened.prediction, opened.run
    return {
        "index": opened.index, "key": opened.key, "phase": opened.phase, "changes": candidate.changes,
        "label": opened.label, "layout": candidate.recipe.layout.label(),
        "prediction": None if prediction is None else {**prediction.to_dict(), "calibrated_tokens_per_s_per_gpu":
                                                      opened.calibrated, "calibrated_peak_gib": opened.calibrated_peak_gib,
                                                      "calibrated_allocated_gib": opened.calibrated_allocated_gib,
                                                      "calibration": opened.calibration},
        "status": "ok" if outcome.ok else "failed",
        "failure": None if outcome.ok else {"class": outcome.failure, "detail": outcome.detail},
        "measured": outcome.measured, "wall_s": round(outcome.wall_s, 3),
        # the trial's cost beyond its steps: what cheaper trials would cut
        "overhead_s": None if not outcome.ok else round(max(0.0, outcome.wall_s - steps_run(outcome, trial_steps)
                                                            * outcome.measured["step_time_mean_s"]), 3),
        "startup_s": read_startup(run.run_dir),  # where the overhead goes (train/startup.py)
        "measured_under": measured_under,
        "run_sha256": run_sha256(run.run_dir) if outcome.ok else None,
        "run_dir": str(run.run_dir.relative_to(out)),
        "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def peak_under_prediction(record: dict[str, Any]) -> float | None:
    """How far the trial's peak reserved memory was above what the search expected under the refit it was ranked
    with, as a share of the device (an out-of-memory: all the device that expectation left free; under expandable
    segments the allocated peak against the allocated expected, the reserve being the planner's); None for a trial
    predicted before any measurement (the start) or without the peaks to compare."""
    prediction = record.get("prediction") or {}
    expected, capacity = prediction.get("calibrated_peak_gib"), prediction.get("capacity_gib")
    if not expected or not capacity or not (prediction.get("calibration") or {}).get("fitted_on"):
        return None
    if record["status"] != "ok":
        failed = (record.get("failure") or {}).get("class") == "out_of_memory"
        return max(0.0, capacity - expected) / capacity if failed else None
    measured = record.get("measured") or {}
    if prediction.get("expandable"):
        allocated, expected_allocated = measured.get("peak_memory_gib"), prediction.get("calibrated_allocated_gib")
        return None if not allocated or not expected_allocated else (allocated - expected_allocated) / capacity
    reserved = measured.get("peak_reserved_gib")
    if not reserved:
        return None
    return (reserved + prediction.get("context_gib", 0.0) - expected) / capacity


def early_end_s(phase: str, records: list[dict[str, Any]], stable_cv: float | None) -> float | None:
    """The step time above which a stable trial of ``phase`` ends early (runner.TrialRun). Remeasured and ablation
    runs are only measured: any stable window ends them. A search trial must run all its steps to be verified as a
    winner (its loss curve against the start's), so only one slower than a trial already measured (by more than
    the bound) ends early; the start, the reference of every other, runs all its steps."""
    if stable_cv is None:
        return None
    if phase in ("remeasure", "ablation"):
        return 0.0
    times = [r["measured"]["step_time_mean_s"] for r in records if r["status"] == "ok"]
    if phase == "start" or not times:
        return None
    return min(times) * (1 + stable_cv)


def steps_run(outcome: Outcome, trial_steps: int) -> int:
    """Steps a measured trial ran: all of them, or up to its window's end when it ended once stable."""
    return min(trial_steps, outcome.measured["window"][1] + 1)


def write_trial_recipe(candidate: Candidate, trial_dir: Path, start_name: str, steps: int, rows: Path) -> Path:
    """The recipe a trial trains: the candidate, on the shared rows, for the trial's steps, without checkpoints;
    only performance-only fields besides steps differ from the candidate."""
    tree = candidate.recipe.model_dump(mode="json")
    tree.update(name=f"{start_name}-{trial_dir.name}", steps=steps, run_dir=str((trial_dir / "run").resolve()),
                data={"rows": str(rows.resolve())})
    tree["checkpoint"] = {"every": None, "keep": 1, "at_end": False}
    tree["logging"] = {**tree["logging"], "progress": False, "tensorboard": False, "wandb": False}
    path = trial_dir / TRIAL_RECIPE
    path.write_text(dump_recipe(recipe_from_dict(tree, source=str(path))))
    return path
