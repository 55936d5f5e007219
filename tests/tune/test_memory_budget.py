"""The tuner where memory binds and time is short: knobs solved from the memory model, an out-of-memory that prunes
what needs as much, a budget kept with verification inside it, and gains that must survive an interleaved
remeasurement (synthetic runners, no training)."""

from __future__ import annotations

import dataclasses
import io
import json
import statistics
import re
from dataclasses import replace
from pathlib import Path

import markupsafe
import pytest

from openrecipes.cards.validate import validate_file
from openrecipes.tune.predict import MEMORY_MARGIN, OUT_OF_MEMORY_TOLERANCE, Calibration
from openrecipes.tune.progress import Progress
from openrecipes.tune.publish import publish
from openrecipes.tune.remeasure import ablate, remeasure
from openrecipes.tune.runner import Outcome
from openrecipes.tune.search import Search, TuneOptions
from openrecipes.tune.solve import least_fitting, solved_offload
from openrecipes.tune.space import first_ranking_space, start_settings
from openrecipes.tune.verification import choose_winner

from .conftest import SyntheticRunner, write_start


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedRunner(SyntheticRunner):
    """The synthetic runner whose trials take their wall time on a fake clock, plus a fixed cost before step 0."""

    def __init__(self, clock: FakeClock, setup_s: float = 10.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.clock, self.setup_s = clock, setup_s

    def run(self, trial, tick=None) -> Outcome:
        outcome = super().run(trial, tick)
        outcome.wall_s += self.setup_s
        self.clock.now += outcome.wall_s
        return outcome


def _search(start: Path, out: Path, runner, *, trials: int = 8, minutes: float = 60, clock=None) -> Search:
    options = TuneOptions(start=start, out=out, gpus="cpu", trials=trials, minutes=minutes, trial_steps=8)
    progress = Progress(trials=trials, minutes=minutes, stream=io.StringIO(), **({"clock": clock} if clock else {}))
    return Search(options, runner, progress)


def _with_capacity(search: Search, capacity_gib: float) -> None:
    hardware = search.planner.hardware
    search.planner.hardware = replace(hardware, gpu=replace(hardware.gpu, memory_gib=capacity_gib))


def _peak(search: Search, settings) -> float:
    candidate = search.candidate_or_none(settings)
    return search.planner.predict(candidate.recipe).peak_reserved_gib


def test_least_fitting_is_the_boundary_of_a_monotone_model():
    peak = lambda n: 150.0 - 5.0 * n  # noqa: E731  (a linear memory model, GiB at n twentieths offloaded)
    limit = 140.0 * (1 - MEMORY_MARGIN)
    found = least_fitting(lambda n: peak(n) <= limit, 0, 20)
    assert found == 4 and peak(found) <= limit < peak(found - 1)
    assert least_fitting(lambda n: False, 0, 20) is None and least_fitting(lambda n: True, 0, 20) == 0


def test_the_offload_fraction_is_solved_where_memory_binds(start_yaml, tmp_path):
    search = _search(start_yaml, tmp_path / "out", SyntheticRunner())
    base = start_settings(search.start, search.facts)
    none, full = _peak(search, replace(base, offload=0.0)), _peak(search, replace(base, offload=1.0))
    assert full < none
    # a device on which the start does not fit without offload, and fits with about a third of it offloaded
    _with_capacity(search, (none - 0.35 * (none - full)) / (1 - MEMORY_MARGIN))
    solved = solved_offload(base, search._fits)
    assert solved is not None and solved.offload not in (0.0, 0.5, 1.0) and 0.0 < solved.offload < 1.0
    assert search._fits(solved) and not search._fits(replace(solved, offload=round(solved.offload - 0.05, 6)))
    # the search ranks it: a candidate with that fraction is among the first ranking
    ranked = {s.offload for s in search._solved([base])}
    assert solved.offload in ranked


def test_a_measured_allocator_reserve_refines_the_solved_fraction(rows_dir, tmp_path):
    # fixed-size segments: their measured reserve is what had to fit (expandable ones keep the planner's)
    start_yaml = write_start(tmp_path / "start.yaml", rows_dir, kernels={"allocator": "caching"})
    search = _search(start_yaml, tmp_path / "out", SyntheticRunner())
    base = start_settings(search.start, search.facts)
    none, full = _peak(search, replace(base, offload=0.0)), _peak(search, replace(base, offload=1.0))
    _with_capacity(search, (none - 0.5 * (none - full)) / (1 - MEMORY_MARGIN))
    prior = solved_offload(base, search._fits)
    # trials measured the allocator holding 1 % above its allocated peak, not the planner's 10 %: less offload fits
    search.calibration = replace(search.calibration, reserve_ratio=(1.01, 1.01))
    measured = solved_offload(base, search._fits)
    assert prior is not None and measured is not None and measured.offload < prior.offload
    assert search._fits(measured) and not search._fits(replace(measured, offload=round(measured.offload - 0.05, 6)))


def test_an_out_of_memory_prunes_what_needs_as_much(start_yaml, tmp_path):
    out = tmp_path / "out"

    class OutOfMemoryAbove(SyntheticRunner):
        """Runs out of memory when the planner predicts at least ``threshold`` GiB (the injected failure)."""
        threshold = float("inf")

        def run(self, trial, tick=None):
            from openrecipes.config.recipe import load_recipe

            if search.planner.predict(load_recipe(trial.recipe_path)).peak_reserved_gib >= self.threshold:
                self.calls.append(trial.run_dir)
                return Outcome(failure="out_of_memory", detail="CUDA out of memory (injected)", wall_s=1.0)
            return super().run(trial, tick)

    # a first search without failures: the peak the planner predicts for the first candidate it measures
    probe = _search(start_yaml, tmp_path / "probe", SyntheticRunner(), trials=2)
    peaks = [_peak(probe, s) for s in first_ranking_space(probe.start, probe.facts)
             if probe.candidate_or_none(s) and not probe.planner.refusal(probe.candidate_or_none(s).recipe)]
    _with_capacity(probe, 1.2 * max(peaks))
    probe.run()
    first = [json.loads(line) for line in (tmp_path / "probe" / "trials.jsonl").read_text().splitlines()][1]
    runner = OutOfMemoryAbove()
    search = _search(start_yaml, out, runner, trials=8)
    # every candidate predicted to need as much as that one runs out; the planner does not know it
    runner.threshold = first["prediction"]["peak_reserved_gib"]
    assert min(peaks) < runner.threshold <= max(peaks)
    _with_capacity(search, 1.2 * max(peaks))
    search.run()
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    failures = [r for r in records if r["status"] == "failed"]
    assert len(failures) == 1 and failures[0]["failure"]["class"] == "out_of_memory"
    assert len(records) == 8  # the search went on below the bound
    pruned = [json.loads(line) for line in (out / "pruned.jsonl").read_text().splitlines()]
    above = [p for p in pruned if p["reason"].startswith("above a measured out-of-memory")]
    bound = failures[0]["prediction"]["peak_reserved_gib"] * (1 - OUT_OF_MEMORY_TOLERANCE)
    assert above and all(p["prediction"]["peak_reserved_gib"] >= bound for p in above)
    assert search.calibration.out_of_memory_gib == failures[0]["prediction"]["peak_reserved_gib"]


def test_a_crash_prunes_every_candidate_that_makes_its_changes(start_yaml, tmp_path):
    out = tmp_path / "out"
    search = _search(start_yaml, out, SyntheticRunner(), trials=1)
    search.options.tries = ("kernels.attention=sdpa debug.fail_at=[1,3]",)
    search.options.trials = 2
    search.run()
    crashed = search.tried[next(k for k in search.tried if k != "start")]
    assert search.journal.find(crashed.key)["failure"]["class"] == "crash"
    more = replace(crashed, changes={**crashed.changes, "layout.rows_per_microbatch": 2})
    assert search._failed_like(more).startswith("makes every change of trial 1, which failed (crash")
    fewer = replace(crashed, changes={"kernels.attention": "sdpa"})
    assert search._failed_like(fewer) is None


def test_the_budget_holds_verification_and_the_gain_is_remeasured(start_yaml, tmp_path):
    clock, out, minutes = FakeClock(), tmp_path / "out", 4.0
    runner = TimedRunner(clock)
    search = _search(start_yaml, out, runner, trials=50, minutes=minutes, clock=clock)
    result = search.run()
    assert 3 <= len(result.records) < 50  # stopped by the budget, not the trial count
    assert "the budget is spent" in search.progress.stream.getvalue()
    winner, failed = choose_winner(result)
    pairs = search.remeasure_pairs(winner.record)  # as many of the two asked as the time left holds, at least one
    gain = remeasure(search, winner.record, pairs)
    assert 1 <= pairs <= 2 and gain.faster and len(gain.pairs) == pairs + 1
    assert len(runner.calls) == len(result.records) + 2 * pairs
    ablations = ablate(search, result.candidates[winner.record["key"]], statistics.median(gain.winner))
    assert clock.now <= minutes * 60 * 1.05
    published = publish(result, winner, failed, minutes=0.5, gain=gain, ablations=ablations)
    loaded, problems = validate_file(published.card)
    assert loaded is not None and not [p for p in problems if p.severity == "error"], problems
    tuning = loaded.card.tuning
    assert tuning.gain.pair_gains == list(gain.pairs) and tuning.gain.median_gain == pytest.approx(gain.median)
    assert "interleaved start/winner pairs" in loaded.card.notes and "contributes" in loaded.card.notes
    # one gain, in the same words, on the card's notes and its page (the site once quoted tuned / start - 1)
    page = (published.site / published.card.relative_to(out / "recipes")).with_suffix(".html").read_text()
    assert gain.describe() in loaded.card.notes and str(markupsafe.escape(gain.describe())) in page
    assert tuning.tuned_tokens_per_s_per_gpu == statistics.median(gain.winner)
    assert all(a.knob for a in tuning.ablations)
    # each trial's cost beyond its steps: the runner's fixed 10 s before step 0
    assert all(t.overhead_s == pytest.approx(10.0, abs=1e-3) for t in tuning.trials if t.failure is None)
    # the card's run names the winning recipe beside it, by a path relative to the output (a repository's root)
    command = loaded.card.run.split()
    assert command[:2] == ["openrecipes", "train"] and not command[2].startswith("/")
    from openrecipes.config.recipe import load_recipe

    assert load_recipe(out / command[2]).layout == result.candidates[winner.record["key"]].recipe.layout


class NoisyRunner(SyntheticRunner):
    """Every recipe runs at the same speed; only the noise differs from run to run (a fixed sequence)."""

    NOISE = (1.0, 0.8, 1.1, 0.9, 1.2, 0.9, 1.1, 0.95, 1.0, 1.0, 1.0, 1.0)

    def run(self, trial, tick=None):
        from openrecipes.config.rundir import METRICS_FILE
        from openrecipes.tune.runner import measure_trial

        outcome = super().run(trial, tick)
        path = trial.run_dir / METRICS_FILE
        factor = self.NOISE[(len(self.calls) - 1) % len(self.NOISE)]
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "step_time_s": 0.5 * factor}) + "\n" for r in lines))
        return dataclasses.replace(outcome, measured=measure_trial(trial.run_dir, trial.window))


@pytest.mark.parametrize("runner_class", [NoisyRunner])
def test_a_gain_inside_the_noise_is_no_faster_recipe(start_yaml, tmp_path, monkeypatch, capsys, runner_class):
    from openrecipes.cli import main

    monkeypatch.setattr("openrecipes.tune.runner.LocalRunner", lambda **options: runner_class())
    out = tmp_path / "out"
    code = main(["tune", str(start_yaml), "--gpus", "cpu", "--trials", "5", "--trial-steps", "8", "--out", str(out)])
    captured = capsys.readouterr()
    printed, progress = captured.out, captured.out + captured.err
    assert code == 0
    assert "no faster recipe found" in printed and "the start stays as it is" in printed
    assert not (out / "recipes").exists()  # no card against itself
    remeasured = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()
                  if json.loads(line)["phase"] == "remeasure"]
    assert len(remeasured) == 4  # start, winner, start, winner
    # the trial named for remeasurement is numbered as trials.jsonl, the card and the trials/ folders number it
    # (from 0, the start); the remeasured runs are labelled as such and counted apart from the 5 trials
    named = int(re.search(r"measuring the start and trial (\d+) again", progress).group(1))
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    winner = next(r for r in records if r["index"] == named)
    assert winner["phase"] != "remeasure" and winner["changes"], winner
    assert f"trial {named} ({named + 1} of 5): " in progress
    assert [f"trial {r['index']} (remeasure): " in progress for r in remeasured] == [True] * 4
    assert all(int(n) <= 5 for n in re.findall(r"\((\d+) of 5\)", progress))  # no count past the trials asked


class PeakRunner(SyntheticRunner):
    """The synthetic runner whose trials report a measured peak memory, as GPU trials do."""

    def run(self, trial, tick=None) -> Outcome:
        outcome = super().run(trial, tick)
        outcome.measured = {**outcome.measured, "peak_memory_gib": 12.5}
        return outcome


def test_each_trial_records_and_prints_the_peak_the_search_expected(start_yaml, tmp_path):
    search = _search(start_yaml, tmp_path / "out", PeakRunner())
    candidate = search.candidate_or_none(start_settings(search.start, search.facts))
    prediction = search.prediction_if_fits(candidate)
    record = search.run_trial(candidate, prediction, "start")
    assert record["prediction"]["calibrated_peak_gib"] == pytest.approx(Calibration().peak_gib(prediction))
    # printed allocated against allocated (the measured peak is allocated memory), not the reserve that must fit
    expected = record["prediction"]["calibrated_allocated_gib"]
    assert expected == pytest.approx(prediction.allocated_gib) and expected < prediction.peak_reserved_gib
    line = next(line for line in search.progress.stream.getvalue().splitlines() if " | best " in line)  # its result
    assert f"peak 12.5 GiB (predicted {expected:.1f}, {100 * (expected / 12.5 - 1):+.1f} %)" in line, line


class LostNodeRunner(SyntheticRunner):
    """The synthetic runner whose trials with debug.fail_at end as Slurm's lost node does."""

    def run(self, trial, tick=None) -> Outcome:
        outcome = super().run(trial, tick)
        if outcome.failure == "crash":
            return Outcome(failure="node_fail", detail="job 7: NODE_FAIL", wall_s=outcome.wall_s)
        return outcome


def test_a_cluster_failure_prunes_nothing(start_yaml, tmp_path):
    """A node lost under a trial says nothing of its recipe: candidates making its changes stay in the search."""
    search = _search(start_yaml, tmp_path / "out", LostNodeRunner(), trials=2)
    search.options.tries = ("kernels.attention=sdpa debug.fail_at=[1,3]",)
    search.run()
    lost = search.tried[next(k for k in search.tried if k != "start")]
    assert search.journal.find(lost.key)["failure"]["class"] == "node_fail"
    assert search._failed_like(replace(lost, changes={**lost.changes, "layout.rows_per_microbatch": 2})) is None


def test_the_reserve_costs_a_rerun_without_the_compile_a_shared_cache_keeps():
    from types import SimpleNamespace

    from openrecipes.tune.budget import SearchBudget, rerun_wall_s, verify_fixed_s

    start = {"key": "start", "status": "ok", "wall_s": 33.0, "startup_s": {"first_step": 4.0}}
    winner = {"key": "w", "status": "ok", "wall_s": 46.0, "startup_s": {"first_step": 28.0},
              "measured": {"tokens_per_s_per_gpu": 2.0}}
    assert rerun_wall_s(winner, start, compile_cache_shared=True) == 22.0  # the 24 s of compiling traced once
    assert rerun_wall_s(winner, start, compile_cache_shared=False) == 46.0  # another node may compile again
    assert rerun_wall_s({"wall_s": 20.0}, start, compile_cache_shared=True) == 20.0  # no startup record
    # a remeasured run ends at its first stable window: 4 of a stable 7-step window (call e's start: 78 s, rerun 52 s)
    stable = {"wall_s": 78.0, "measured": {"window": [5, 11], "step_time_cv": 0.006, "step_time_mean_s": 3.6}}
    assert rerun_wall_s(stable, stable, compile_cache_shared=True, stable_cv=0.02) == pytest.approx(78.0 - 3 * 3.6)
    noisy = {**stable, "measured": {**stable["measured"], "step_time_cv": 0.05}}
    assert rerun_wall_s(noisy, noisy, compile_cache_shared=True, stable_cv=0.02) == 78.0  # it may run every step
    assert rerun_wall_s(stable, stable, compile_cache_shared=True, stable_cv=None) == 78.0  # no early end

    class Budget(SearchBudget):
        def __init__(self, shared: bool) -> None:
            records = {"start": {**start, "measured": {"tokens_per_s_per_gpu": 1.0}}, "w": winner}
            self.journal = SimpleNamespace(find=records.get, records=list(records.values()))
            self.runner = SimpleNamespace(compile_cache_shared=shared)
            self.options = SimpleNamespace(remeasure=2, stable_cv=0.02)
            self.target = SimpleNamespace(is_cpu=False)
            self.tried, self.searching = {"start": None, "w": SimpleNamespace(key="w")}, True
            self.reference = SimpleNamespace(key="start")  # the start fitted: it is what was measured first

    fixed = verify_fixed_s(False)
    assert Budget(shared=True).reserve_s() == pytest.approx(33.0 + 22.0 + fixed)
    assert Budget(shared=False).reserve_s() == pytest.approx(33.0 + 46.0 + fixed)
