"""The search loop with a synthetic runner (no training): it finds the faster recipe, records failures and goes
on, resumes after a kill without rerunning finished trials, and publishes a card that validates with its chart."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import yaml

from openrecipes.cards.paths import absolute_paths
from openrecipes.cards.validate import validate_file
from openrecipes.config.recipe import load_recipe
from openrecipes.tune.progress import Progress
from openrecipes.tune.publish import publish
from openrecipes.tune.search import Search, TuneOptions
from openrecipes.tune.verification import choose_winner
from openrecipes.verify.rules import compare_recipes

from .conftest import SyntheticRunner


def _search(start: Path, out: Path, runner, *, trials: int = 6, tries: tuple[str, ...] = ()) -> Search:
    options = TuneOptions(start=start, out=out, gpus="cpu", trials=trials, minutes=60, trial_steps=8, tries=tries)
    return Search(options, runner, Progress(trials=trials, minutes=60, stream=io.StringIO()))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]


def test_search_finds_a_faster_verified_recipe_and_records_a_failure(start_yaml, tmp_path):
    out = tmp_path / "out"
    runner = SyntheticRunner()
    result = _search(start_yaml, out, runner, trials=6, tries=("debug.fail_at=[1,3]",)).run()
    records = _records(out)
    assert [r["index"] for r in records] == list(range(6)) and len(runner.calls) == 6
    assert records[0]["key"] == "start" and records[0]["phase"] == "start"
    failed = records[1]
    assert failed["status"] == "failed" and failed["failure"]["class"] == "crash"
    assert failed["changes"] == {"debug.fail_at": [1, 3]}
    assert [r["status"] for r in records[2:]] == ["ok"] * 4  # the search went on
    assert {r["phase"] for r in records[2:]} == {"ranked", "around-best"}
    start_tps = records[0]["measured"]["tokens_per_s_per_gpu"]
    best = max(r["measured"]["tokens_per_s_per_gpu"] for r in records if r["measured"])
    assert best > 1.5 * start_tps
    # the refit moves the predictions towards the measurements (the start's own prediction was not fitted)
    last = records[-1]
    assert last["prediction"]["calibration"]["fitted_on"] >= 3
    for record in records:
        if record["status"] == "ok" and record["key"] != "start":
            assert compare_recipes(result.candidates[record["key"]].recipe, result.start).passed

    winner, rejected = choose_winner(result)
    assert winner is not None and not rejected
    assert winner.record["measured"]["tokens_per_s_per_gpu"] == best
    published = publish(result, winner, rejected, minutes=0.5)
    assert published.status == "verified"
    loaded, problems = validate_file(published.card)
    assert loaded is not None and not [p for p in problems if p.severity == "error"], problems
    card = loaded.card
    assert card.status == "verified" and card.correctness.result == "pass"
    assert card.tuning.start_tokens_per_s_per_gpu == start_tps and card.tuning.tuned_tokens_per_s_per_gpu == best
    assert [t.failure for t in card.tuning.trials].count("crash") == 1
    assert f"{start_tps:,.1f} tokens/s/GPU; tuned to {best:,.1f} (one run each); 6 trials in 0.5 minutes" in card.notes
    tuned = load_recipe(published.recipe)
    assert compare_recipes(tuned, result.start).passed and tuned.data == result.start.data
    # a card anyone can rerun: no machine path of this run (the output and the rows lie under /tmp here), the
    # trials named inside the tuning output, the recipe the tuned one
    text = published.card.read_text()
    assert str(tmp_path) not in text and not absolute_paths(yaml.safe_load(text)), absolute_paths(yaml.safe_load(text))
    assert f"run directory {winner.record['run_dir']}" in card.notes
    assert yaml.safe_load(card.recipe)["run_dir"] == tuned.run_dir
    page = (published.site / "qwen3-moe-tiny" / "cpu" / "slow-start-tuned.html").read_text()
    plotted = re.sub(r'<g class="legend-mark[^"]*">.*?</g>', "", page)  # the legend draws one mark of each kind
    assert 'id="tuning-chart"' in page and plotted.count('class="measured') == 5
    assert plotted.count('<g class="failed"') == 1 and 'class="start-line"' in plotted


def test_kill_and_rerun_reuses_finished_trials(start_yaml, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _search(start_yaml, out, SyntheticRunner(interrupt_at=3), trials=5).run()
    finished = _records(out)
    assert len(finished) == 2
    half = [p for p in (out / "trials").iterdir() if (p / "run" / "half-written").exists()]
    assert len(half) == 1
    again = SyntheticRunner()
    _search(start_yaml, out, again, trials=5).run()
    records = _records(out)
    assert records[:2] == finished  # reused, never rerun
    assert len(records) == 5 and len(again.calls) == 3
    assert again.calls[0].parent == half[0] and not (half[0] / "run" / "half-written").exists()
    # a third run has nothing left to do
    idle = SyntheticRunner()
    _search(start_yaml, out, idle, trials=5).run()
    assert idle.calls == [] and _records(out) == records


def test_rerun_with_other_settings_is_refused(start_yaml, tmp_path):
    out = tmp_path / "out"
    _search(start_yaml, out, SyntheticRunner(), trials=1).run()
    options = TuneOptions(start=start_yaml, out=out, gpus="cpu", trials=1, trial_steps=10)
    with pytest.raises(ValueError, match="trial_steps"):
        Search(options, SyntheticRunner())


def test_a_numerics_change_given_with_try_is_refused(start_yaml, tmp_path):
    search = _search(start_yaml, tmp_path / "out", SyntheticRunner(), tries=("optimizer.lr=1e-3",))
    with pytest.raises(ValueError, match="optimizer.lr is a numerics field"):
        search.run()


def test_a_trial_that_ended_early_is_not_verified(start_yaml, tmp_path):
    """A run that ended once stable has too few steps for the convergence check: the next fastest is verified."""
    result = _search(start_yaml, tmp_path / "out", SyntheticRunner(), trials=4).run()
    faster = sorted((r for r in result.records if r["key"] != "start" and r["status"] == "ok"),
                    key=lambda r: -r["measured"]["tokens_per_s_per_gpu"])
    first, last = faster[0]["measured"]["window"]
    faster[0]["measured"]["window"] = (first, last - 1)  # as a record of a trial that ended a step early
    winner, failed = choose_winner(result)
    assert [v.record["key"] for v in failed] == [faster[0]["key"]]
    assert "too short for the convergence check" in failed[0].failures[0]
    assert winner is not None and winner.record["key"] == faster[1]["key"]


def test_a_start_train_would_refuse_is_refused_before_any_trial(tmp_path, rows_dir):
    from .conftest import write_start

    start = write_start(tmp_path / "start.yaml", rows_dir, layout={"dp": 1, "tp": 3, "max_tokens_per_gpu": 256})
    runner = SyntheticRunner()
    with pytest.raises(ValueError, match=r"the starting point: openrecipes train refuses its layout: layout\.tp"):
        _search(start, tmp_path / "out", runner).run()
    assert runner.calls == []


def test_a_start_cut_by_the_budget_says_the_budget_is_short(start_yaml, tmp_path):
    from openrecipes.tune.runner import Outcome

    class TooSlow(SyntheticRunner):
        def run(self, trial, tick=None):
            self.calls.append(trial)
            return Outcome(failure="timeout", detail=f"stopped after the trial limit of {trial.timeout_s:.0f} s")

    options = TuneOptions(start=start_yaml, out=tmp_path / "out", gpus="cpu", trials=4, minutes=0.05, trial_steps=8)
    search = Search(options, TooSlow(), Progress(trials=4, minutes=0.05, stream=io.StringIO()))
    with pytest.raises(ValueError, match=r"did not finish within --minutes 0\.05 .* give more minutes"):
        search.run()


def test_nproc_above_the_starts_world_size_says_how_to_tune_on_more(start_yaml, tmp_path):
    # the start sets dp, so its world size is fixed: more processes than that is a different start
    start_world = load_recipe(start_yaml).layout.world_size

    def search(gpus: str) -> Search:
        options = TuneOptions(start=start_yaml, out=tmp_path / "out", gpus=gpus, nproc=8, trials=1, trial_steps=8)
        return Search(options, SyntheticRunner(), Progress(trials=1, minutes=60, stream=io.StringIO()))

    with pytest.raises(ValueError, match=rf"--nproc 8: the start runs on {start_world} process\(es\).*"
                                         r"give the start a layout of 8 .* --gpus 8xcpu"):
        search(f"{start_world}xcpu")
    with pytest.raises(ValueError, match=rf"--nproc 8 with --gpus cpu: 8 devices, .* uses {start_world}"):
        search("cpu")
