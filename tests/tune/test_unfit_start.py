"""A start that does not fit (issue 55, item 3): predicted not to fit, the tuner says so before any trial, measures
the smallest change of its memory knobs that fits as the reference and tunes from it; a start whose trial runs out of
memory falls back the same way; when nothing fits, one line and no trial. The card names both (synthetic runners: a
memory model where the optimizer offload binds, the planner's speeds)."""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace

import pytest

from openrecipes.cards.validate import validate_file
from openrecipes.config.recipe import load_recipe
from openrecipes.tune.predict import MEMORY_MARGIN, Planner
from openrecipes.tune.progress import Progress
from openrecipes.tune.runner import Outcome
from openrecipes.tune.search import Search, TuneOptions
from openrecipes.tune.solve import solved_offload
from openrecipes.tune.space import start_settings
from openrecipes.tune.trial import TRIAL_RECIPE
from openrecipes.verify.rules import compare_recipes

from .conftest import SyntheticRunner

CONTEXT_GIB = 0.6


def allocated_gib(recipe) -> float:
    """A device where the optimizer's state binds: 110 GiB without offload, 40 GiB less wholly offloaded."""
    return 110.0 - 40.0 * recipe.offload.fraction


@pytest.fixture
def offload_binds(monkeypatch):
    """The planner's predictions with that memory model (its capacity stays the planner's: --gpu-memory-gib)."""
    predict = Planner.predict

    def patched(self, recipe):
        allocated = allocated_gib(recipe)
        return replace(predict(self, recipe), allocated_gib=allocated, peak_reserved_gib=allocated + CONTEXT_GIB,
                       context_gib=CONTEXT_GIB)

    monkeypatch.setattr(Planner, "predict", patched)


class OutOfMemoryRunner(SyntheticRunner):
    """Runs out of memory where the device really holds less than ``real_gib`` (the planner does not know it)."""

    def __init__(self, real_gib: float) -> None:
        super().__init__()
        self.real_gib = real_gib

    def run(self, trial, tick=None):
        if allocated_gib(load_recipe(trial.recipe_path)) + CONTEXT_GIB > self.real_gib:
            self.calls.append(trial.run_dir)
            return Outcome(failure="out_of_memory", detail="CUDA out of memory (injected)", wall_s=1.0)
        return super().run(trial, tick)


def _tune(monkeypatch, capsys, start_yaml, out, runner, *extra) -> tuple[int, str, str]:
    from openrecipes.cli import main

    monkeypatch.setattr("openrecipes.tune.runner.LocalRunner", lambda **options: runner)
    code = main(["tune", str(start_yaml), "--gpus", "cpu", "--trials", "6", "--trial-steps", "8", "--remeasure", "1",
                 "--out", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]


def _card(out):
    cards = list((out / "recipes").rglob("*-tuned.yaml"))
    assert len(cards) == 1, cards
    loaded, problems = validate_file(cards[0])
    assert loaded is not None and not [p for p in problems if p.severity == "error"], problems
    return loaded.card


def _solved_reference(start_yaml, tmp_path, capacity_gib: float) -> float:
    """The least offload fraction the search's memory model fits into ``capacity_gib`` with the margin free."""
    options = TuneOptions(start=start_yaml, out=tmp_path / "probe", gpus="cpu", trials=2, trial_steps=8,
                          gpu_memory_gib=capacity_gib)
    search = Search(options, SyntheticRunner(), Progress(trials=2, minutes=30, stream=io.StringIO()))
    return solved_offload(start_settings(search.start, search.facts), search._fits).offload


def test_a_start_predicted_not_to_fit_is_tuned_from_the_smallest_change_that_fits(
        offload_binds, monkeypatch, capsys, start_yaml, tmp_path):
    out, runner = tmp_path / "out", SyntheticRunner()
    fraction = _solved_reference(start_yaml, tmp_path, 100.0)
    assert 110.0 - 40.0 * fraction + CONTEXT_GIB <= 100.0 * (1 - MEMORY_MARGIN) < 110.0 + CONTEXT_GIB
    code, printed, progress = _tune(monkeypatch, capsys, start_yaml, out, runner, "--gpu-memory-gib", "100")
    assert code == 0, progress
    # said before any trial, with the start's peak, the device, the margin and the reference
    said = (f"the start is predicted at {110.0 + CONTEXT_GIB:.4g} GiB of 100 GiB (5 % left free: at most 95 GiB): it "
            f"does not fit; tuning from offload.fraction={fraction:g} instead (predicted "
            f"{110.0 - 40.0 * fraction + CONTEXT_GIB:.4g} GiB)")
    assert said in progress and progress.index(said) < progress.index("trial 0 "), progress
    records = _records(out)
    # the start never ran: trial 0 is the reference, the solved fraction (fewest knobs, then fastest predicted)
    assert not any(r["key"] == "start" for r in records)
    assert records[0]["phase"] == "start" and records[0]["changes"] == {"offload.fraction": fraction}
    recipes = [load_recipe(path.parent / TRIAL_RECIPE) for path in runner.calls]
    assert all(allocated_gib(r) + CONTEXT_GIB <= 95.0 for r in recipes)  # every trial fits with the margin
    start = load_recipe(start_yaml).model_copy(update={"steps": 8})  # the trials' steps
    assert all(compare_recipes(r, start).passed for r in recipes), [compare_recipes(r, start).numerics for r in recipes]
    card = _card(out)
    assert card.status == "verified"
    reference, trials = card.tuning.reference, card.tuning.trials
    assert reference is not None and reference.start_failure is None and reference.start == "start.yaml"
    assert reference.changes == f"offload.fraction={fraction:g}" == trials[0].changes and trials[0].role == "start"
    assert reference.start_predicted_peak_gib == pytest.approx(110.0 + CONTEXT_GIB) and reference.capacity_gib == 100
    # the card names both: the start that did not fit and the reference its figures are against
    assert "The starting point start.yaml did not fit" in card.notes and reference.changes in card.notes
    assert card.tuning.start_tokens_per_s_per_gpu == pytest.approx(
        json.loads((out / "tune.json").read_text())["result"]["start_tokens_per_s_per_gpu"])
    tuned = load_recipe(out / "tuned.yaml")
    assert compare_recipes(tuned, load_recipe(start_yaml)).passed and tuned.offload.fraction >= fraction
    # a rerun walks the same path: the reference and every trial reused, nothing run again
    again = SyntheticRunner()
    code, _, progress = _tune(monkeypatch, capsys, start_yaml, out, again, "--gpu-memory-gib", "100")
    assert code == 0 and again.calls == [] and said in progress


def test_a_start_that_runs_out_of_memory_falls_back_to_a_reference(offload_binds, monkeypatch, capsys, start_yaml,
                                                                   tmp_path):
    # predicted to fit 200 GiB; the device holds 105 GiB at most, which the planner does not know
    out, runner = tmp_path / "out", OutOfMemoryRunner(real_gib=105.0)
    code, printed, progress = _tune(monkeypatch, capsys, start_yaml, out, runner, "--gpu-memory-gib", "200")
    assert code == 0, progress
    assert "the starting point failed" not in progress
    records = _records(out)
    assert records[0]["key"] == "start" and records[0]["failure"]["class"] == "out_of_memory"
    said = re.search(r"the start ran out of memory though predicted at ([\d.]+) GiB of 200 GiB; tuning from (\S+) "
                     r"instead", progress)
    assert said and float(said.group(1)) == pytest.approx(110.0 + CONTEXT_GIB, abs=0.05), progress
    # the next reference below the bound the out-of-memory set (those that ran out too bounded it further)
    reference = next(r for r in records if r["phase"] == "start" and r["status"] == "ok")
    assert all(r["failure"]["class"] == "out_of_memory" for r in records[:records.index(reference)])
    assert allocated_gib(load_recipe((out / reference["run_dir"]).parent / TRIAL_RECIPE)) + CONTEXT_GIB <= 105.0
    chosen = re.findall(r"; tuning from (\S+) instead", progress)
    assert chosen[-1] == reference["label"] and len(chosen) == records.index(reference)
    assert progress.count("the reference ran out of memory too") == len(chosen) - 1
    card = _card(out)
    tuning = card.tuning
    assert card.status == "verified" and tuning.reference.start_failure == "out_of_memory"
    assert tuning.trials[0].failure == "out_of_memory" and tuning.trials[0].changes == "the starting point"
    start = next(t for t in tuning.trials if t.role == "start")
    assert start.trial == reference["index"] and start.changes == tuning.reference.changes == reference["label"]
    assert "ran out of memory" in card.notes and "The starting point start.yaml did not fit" in card.notes


def test_a_start_that_nothing_fits_is_one_line_before_any_trial(offload_binds, monkeypatch, capsys, start_yaml,
                                                                tmp_path):
    runner = SyntheticRunner()
    code, printed, progress = _tune(monkeypatch, capsys, start_yaml, tmp_path / "out", runner,
                                    "--gpu-memory-gib", "50")
    assert code == 2 and runner.calls == []  # a user error: one line, no trial
    errors = [line for line in progress.splitlines() if "error:" in line]
    assert len(errors) == 1, progress
    assert ("the start is predicted at 110.6 GiB of 50 GiB (5 % left free), and no change of its memory knobs"
            in errors[0]), errors
    assert not (tmp_path / "out" / "trials.jsonl").exists()


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "lots"])
def test_gpu_memory_gib_is_checked_when_parsed(capsys, start_yaml, tmp_path, value):
    from openrecipes.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["tune", str(start_yaml), "--gpus", "cpu", "--gpu-memory-gib", value, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2 and "--gpu-memory-gib" in capsys.readouterr().err
    options = TuneOptions(start=start_yaml, out=tmp_path / "out", gpus="cpu", gpu_memory_gib=float("nan"))
    with pytest.raises(ValueError, match="--gpu-memory-gib: a finite number of GiB above 0, got nan"):
        Search(options, SyntheticRunner(), Progress(trials=2, minutes=30, stream=io.StringIO()))


def test_gpu_memory_gib_is_what_candidates_fit(start_yaml, tmp_path):
    options = TuneOptions(start=start_yaml, out=tmp_path / "out", gpus="cpu", gpu_memory_gib=12.5)
    search = Search(options, SyntheticRunner(), Progress(trials=2, minutes=30, stream=io.StringIO()))
    assert search.planner.predict(search.start).capacity_gib == 12.5


@pytest.mark.slow  # about two minutes on two cores
def test_tune_from_a_start_that_does_not_fit_on_two_processes(tmp_path):
    """For real (the tiny model, two gloo processes): a pipeline start the planner predicts at several GiB more than
    the layouts without one, on a device given as half of it; the card is verified against the fitting reference."""
    import os
    import subprocess
    import sys

    from .conftest import write_start

    start_yaml = write_start(tmp_path / "start.yaml", layout={"pp": 2, "dp": 1, "max_tokens_per_gpu": 256})
    probe = Search(TuneOptions(start=start_yaml, out=tmp_path / "probe", gpus="cpu", trials=2, trial_steps=8),
                   SyntheticRunner(), Progress(trials=2, minutes=30, stream=io.StringIO()))
    peak = probe.calibration.peak_gib(probe.planner.predict(probe.start))
    capacity = round(0.5 * peak / (1 - MEMORY_MARGIN), 3)  # the start does not fit; a layout without pp does
    out = tmp_path / "out"
    command = [sys.executable, "-m", "openrecipes", "tune", str(start_yaml), "--gpus", "cpu", "--trials", "3",
               "--trial-steps", "8", "--remeasure", "1", "--minutes", "15", "--gpu-memory-gib", str(capacity),
               "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"the start is predicted at {peak:.4g} GiB of {capacity:.4g} GiB" in result.stderr, result.stderr[-4000:]
    records = _records(out)
    assert records[0]["phase"] == "start" and records[0]["status"] == "ok" and records[0]["changes"]
    assert not any(r["key"] == "start" for r in records)  # the start itself never ran
    assert all(load_recipe((out / r["run_dir"]).parent / TRIAL_RECIPE).layout.pp == 1 for r in records)
    card = _card(out)
    reference = card.tuning.reference
    assert card.status == "verified" and card.correctness.convergence.result == "pass"
    assert reference.start == "start.yaml" and reference.changes == records[0]["label"] and "layout.pp=1" in \
        reference.changes
    assert reference.start_predicted_peak_gib > capacity * (1 - MEMORY_MARGIN) >= reference.predicted_peak_gib
    assert "The starting point start.yaml did not fit" in card.notes and reference.changes in card.notes
    assert compare_recipes(load_recipe(out / "tuned.yaml"), load_recipe(start_yaml)).passed
