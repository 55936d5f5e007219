"""The budget counts what compiling adds to a trial: a first compile (the prior until one was measured, then the
measured), less for graphs a shared compile cache has traced already; a compiled candidate that no longer fits in
the time left is passed over for one that does, instead of being cut at its limit (synthetic runners, no training)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from openrecipes.tune.budget import FIRST_COMPILE_S, compile_s
from openrecipes.tune.runner import Outcome
from openrecipes.tune.space import start_settings

from .test_memory_budget import FakeClock, TimedRunner, _search


def _settings(search, **knobs):
    return replace(start_settings(search.start, search.facts), **knobs)


def test_compile_time_is_the_measured_one_less_where_the_graphs_are_cached(start_yaml, tmp_path):
    search = _search(start_yaml, tmp_path / "out", TimedRunner(FakeClock()))
    compiled = _settings(search, compile=True)
    other_offload = replace(compiled, offload=0.5)  # the optimizer's offload runs outside the compiled graphs
    other_rows = replace(compiled, rows=compiled.rows + 1)
    assert compile_s([], compiled, cache_shared=True) == FIRST_COMPILE_S
    measured = [(compiled, 40.0), (other_rows, 25.0)]
    assert compile_s(measured, other_offload, cache_shared=True) == 40.0  # traced once: what that trial took
    assert compile_s(measured + [(other_offload, 4.0)], compiled, cache_shared=True) == 4.0  # then cached
    assert compile_s(measured + [(other_offload, 4.0)], compiled, cache_shared=False) == 40.0  # compiled again
    assert compile_s(measured, replace(compiled, attention="flex"), cache_shared=True) == 40.0  # new graphs


class CompilingRunner(TimedRunner):
    """Compiled trials take ``compile_s`` more, ``cached_s`` once their graphs were compiled (one shared cache);
    a trial past its limit is cut there, as the local runner cuts it."""

    compile_cache_shared = True

    def __init__(self, clock: FakeClock, compile_s: float, cached_s: float) -> None:
        super().__init__(clock)
        self.compile_s, self.cached_s, self.traced = compile_s, cached_s, set()
        self.limits: list[float] = []

    def run(self, trial, tick=None) -> Outcome:
        from openrecipes.config.recipe import load_recipe

        recipe = load_recipe(trial.recipe_path)
        started = self.clock.now
        outcome = super().run(trial, tick)
        if recipe.kernels.compile:
            graphs = recipe.model_dump_json(exclude={"offload", "run_dir", "steps"})
            outcome.wall_s += self.cached_s if graphs in self.traced else self.compile_s
            self.traced.add(graphs)
        if outcome.wall_s > trial.timeout_s:
            outcome = Outcome(failure="timeout", detail=f"no result within {trial.timeout_s:.0f} s",
                              wall_s=trial.timeout_s)
        self.clock.now = started + outcome.wall_s
        return outcome


@pytest.mark.parametrize("minutes", [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0])
def test_a_search_with_compiled_trials_keeps_its_budget_without_cutting_one(start_yaml, tmp_path, minutes):
    clock = FakeClock()
    runner = CompilingRunner(clock, compile_s=28.0, cached_s=3.0)
    search = _search(start_yaml, tmp_path / "out", runner, trials=40, minutes=minutes, clock=clock)
    search.options.tries = tuple(f"kernels.compile=true {more}" for more in (
        "", "kernels.attention=sdpa", "recompute.granularity=none", "kernels.attention=sdpa recompute.granularity=none",
        "recompute.granularity=selective", "kernels.attention=sdpa recompute.granularity=selective"))
    result = search.run()
    compiled = [r for r in result.records if r["prediction"] and r["prediction"].get("compiled")]
    assert all(r["status"] == "ok" for r in result.records), [(r["changes"], r.get("failure")) for r in result.records]
    assert compiled or minutes < 3  # from 3 minutes on the budget holds a first compile
    assert clock.now <= minutes * 60


def test_a_compiled_candidate_that_no_longer_fits_is_passed_over(start_yaml, tmp_path):
    clock = FakeClock()
    search = _search(start_yaml, tmp_path / "out", TimedRunner(clock), trials=10, minutes=10, clock=clock)
    from openrecipes.tune.search import Ranked
    from openrecipes.tune.space import Candidate

    start = Candidate(settings=start_settings(search.start, search.facts), recipe=search.start, changes={})
    search.run_trial(start, search.planner.predict(search.start), "start")
    ranked = []
    for knobs in ({"compile": True}, {"rows": 2}):
        candidate = search.candidate_or_none(_settings(search, **knobs))
        ranked.append(Ranked(candidate=candidate, prediction=search.planner.predict(candidate.recipe)))
    eager_wall = search.estimated_wall_s(ranked[1].prediction, ranked[1].candidate.settings)
    compiled_wall = search.estimated_wall_s(ranked[0].prediction, ranked[0].candidate.settings)
    assert compiled_wall > FIRST_COMPILE_S > eager_wall
    # the time left holds the eager trial and the reserve, not the compiled one's first compile
    clock.now = search.options.minutes * 60 - (eager_wall + search.reserve_s(compiled_wall) + 1.0)
    assert search._first_within_budget(ranked) is ranked[1]
    assert search._first_within_budget(ranked) is ranked[1]
    said = search.progress.stream.getvalue()
    assert said.count("passed over kernels.compile=true: its trial would take about") == 1, said
    clock.now = search.options.minutes * 60 - 1.0
    assert search._first_within_budget(ranked) is None



def test_the_reserve_holds_the_next_trial_only_where_it_may_win_and_without_its_compile(start_yaml, tmp_path):
    from openrecipes.tune.budget import CARD_S, pairs_reserve_s
    from openrecipes.tune.space import Candidate

    clock = FakeClock()
    search = _search(start_yaml, tmp_path / "out", CompilingRunner(clock, compile_s=28.0, cached_s=3.0),
                     trials=10, minutes=10, clock=clock)
    start = Candidate(settings=start_settings(search.start, search.facts), recipe=search.start, changes={})
    record = search.run_trial(start, search.planner.predict(search.start), "start")
    start_tps, start_wall = record["measured"]["tokens_per_s_per_gpu"], record["wall_s"]
    compiled = search.candidate_or_none(_settings(search, compile=True))
    planned = search.planner.predict(compiled.recipe)

    def predicted_at(fraction: float):  # the same trial predicted at ``fraction`` of the start's throughput
        scale = fraction * start_tps / search.calibration.tokens_per_s_per_gpu(planned)
        return replace(planned, tokens_per_s_per_gpu=planned.tokens_per_s_per_gpu * scale)

    def reserve_for(wall: float) -> float:
        return pairs_reserve_s(start_wall, wall, search.options.remeasure, on_cpu=True)

    assert search.reserve_s(100.0, predicted_at(0.5)) == CARD_S  # slower than the start: never remeasured
    assert search.reserve_s(100.0, predicted_at(0.95)) == pytest.approx(reserve_for(100.0))
    assert search.reserve_s(100.0) == pytest.approx(reserve_for(100.0))  # no prediction: held, to be safe
    wall, reserve = search._time_needed(predicted_at(2.0), compiled.settings)
    assert wall == pytest.approx(search.estimated_wall_s(predicted_at(2.0), compiled.settings))
    assert reserve == pytest.approx(reserve_for(wall - FIRST_COMPILE_S))  # rerun with its graphs cached


def test_the_start_s_optimizer_set_up_scales_with_the_offloaded_share():
    from openrecipes.tune.budget import estimated_wall_s, start_outside_s

    start = {"wall_s": 89.0, "measured": {"step_time_mean_s": 3.8}, "startup_s": {"optimizer": 17.0, "build": 0.2}}
    outside = 89.0 - 12 * 3.8
    assert start_outside_s(start, 12) == pytest.approx(outside)
    assert start_outside_s(start, 12, offload_share=0.15) == pytest.approx(outside - 17.0 * 0.85)
    assert start_outside_s(start, 12, offload_share=0.0) == pytest.approx(outside - 17.0)
    assert start_outside_s({**start, "startup_s": None}, 12, 0.0) == pytest.approx(outside)  # phases unknown
    assert estimated_wall_s(start, 12, 1.8, 4.0, 0.15) == pytest.approx(outside - 17.0 * 0.85 + 4.0 + 12 * 1.8)
