"""The search space: only performance-only fields ever change, and the guard that makes a numerics change impossible
does refuse one."""

from __future__ import annotations

import itertools

import pytest
from dataclasses import replace

from openrecipes.config.layout import rows_per_microbatch
from openrecipes.config.recipe import Kernels, load_recipe
from openrecipes.tune import space
from openrecipes.tune.space import (ModelFacts, candidate_recipe, check_performance_only, first_ranking_space,
                                    neighbours, start_settings)
from openrecipes.config.numerics import PERFORMANCE, classify
from openrecipes.verify.rules import compare_recipes

FACTS = ModelFacts(num_layers=4, num_experts=8, kv_heads=2, row_tokens=256, world_size=2)


def _candidates(start):
    found = {}
    for settings in first_ranking_space(start, FACTS):
        try:
            candidate = candidate_recipe(start, settings, FACTS)
        except ValueError as error:
            assert "numerics" not in str(error)
            continue
        found[candidate.key] = candidate
    return found


def test_every_candidate_changes_performance_only_fields(start_yaml):
    start = load_recipe(start_yaml)
    candidates = _candidates(start)
    # one knob and two knobs away from a few of them: the moves of the local search
    for candidate in list(candidates.values())[:5]:
        for _, settings in neighbours(candidate.settings, start, FACTS):
            moved = candidate_recipe(start, settings, FACTS)
            candidates[moved.key] = moved
    assert len(candidates) > 100
    for candidate in candidates.values():
        report = compare_recipes(candidate.recipe, start)
        assert report.passed, report.numerics
        assert candidate.changes == {d.path: d.candidate for d in report.performance}
        assert all(classify(path).kind == PERFORMANCE for path in candidate.changes)
        # same global batch, whole rows per microbatch on every data-parallel rank
        rows = rows_per_microbatch(candidate.recipe.layout, 256)
        assert (start.global_batch // candidate.recipe.layout.dp) % rows == 0
        assert candidate.recipe.global_batch == start.global_batch


def test_the_space_holds_every_kind_of_change(start_yaml):
    start = load_recipe(start_yaml)
    candidates = _candidates(start).values()
    changes = [c.changes for c in candidates]
    layouts = {c.recipe.layout.label() for c in candidates}
    assert {"TP2 PP1 EP1 DP1 SP", "TP1 PP1 CP2 EP1 DP1", "TP1 PP1 EP2 DP2", "TP1 PP1 EP1 ETP2 DP2",
            "TP1 PP2 EP1 DP1", "TP1 PP2(1/3) EP1 DP1", "TP1 PP2(3/1) EP1 DP1"} <= layouts
    assert any(c.get("recompute.granularity") == "none" for c in changes)
    assert any(c.get("recompute.method") == "block" for c in changes)
    # the offload endpoints are listed; a fraction between them is solved (test_solve) and refined one step
    assert any(c.get("offload.fraction") == 1.0 for c in changes)
    assert not any(c.get("kernels.compile") for c in changes)  # no prior for the target: compile comes later
    compiled = [s for s in first_ranking_space(start, FACTS, with_compile=True) if s.compile]
    assert compiled and all(dict(s.layout)["tp"] == dict(s.layout)["cp"] == 1 for s in compiled)
    quarter = replace(start_settings(start, FACTS), offload=0.25, recompute=("full", "block", 2))
    near = {knob: {getattr(s, knob) for k, s in neighbours(quarter, start, FACTS) if k == knob}
            for knob in ("offload", "recompute")}
    assert near["offload"] == {0.0, 0.2, 0.3, 1.0}
    assert {("full", "block", 1), ("full", "block", 3)} <= near["recompute"]
    assert any(c.get("layout.rows_per_microbatch") == 4 for c in changes)
    assert any(c.get("recompute.granularity") == "attention_core" for c in changes)
    assert any(c.get("recompute.granularity") == "experts" and c.get("recompute.method") == "block" for c in changes)
    moves = neighbours(start_settings(start, FACTS), start, FACTS)
    assert {knob for knob, _ in moves} == {"layout", "rows", "recompute", "offload", "attention", "experts",
                                           "compile", "offload_activations", "loss_chunk"}
    moved = {knob: candidate_recipe(start, settings, FACTS).changes for knob, settings in moves
             if knob in ("offload_activations", "loss_chunk")}
    assert moved["offload_activations"] == {"offload.activations": True}
    assert moved["loss_chunk"] in ({"kernels.loss_chunk_tokens": 2048}, {"kernels.loss_chunk_tokens": 8192})
    # the exact oracle kernels are for checking, never a move
    kernels = {settings.attention for knob, settings in moves if knob == "attention"} | \
        {settings.experts for knob, settings in moves if knob == "experts"}
    assert kernels and not kernels & {"reference", "loop"}


def test_a_numerics_change_is_refused_before_any_trial(start_yaml, monkeypatch):
    start = load_recipe(start_yaml)
    settings = start_settings(start, FACTS)
    real = space.recipe_from_dict

    def sneaky(tree, **kwargs):  # a bug in the space that would slip in a learning rate
        tree["optimizer"]["lr"] = 1e-3
        return real(tree, **kwargs)

    monkeypatch.setattr(space, "recipe_from_dict", sneaky)
    with pytest.raises(ValueError, match="changes numerics fields: optimizer.lr"):
        candidate_recipe(start, settings, FACTS)
    for path in ("global_batch", "optimizer.moment_dtype", "precision", "seed", "data.build.rows"):
        with pytest.raises(ValueError, match=f"{path} is a numerics field"):
            check_performance_only({path: 1})
    check_performance_only({"layout.dp": 2, "kernels.attention": "sdpa", "offload.fraction": 0.5})


def test_kernels_a_target_cannot_run_are_never_offered(start_yaml):
    """On CPU processes neither flash varlen attention nor grouped_mm experts run: a trial of them would only crash.
    grouped_mm also needs bf16, so an fp32 start never gets it, even on GPUs."""
    start = load_recipe(start_yaml)

    def offered(facts, recipe):
        moves = neighbours(start_settings(recipe, facts), recipe, facts)
        return ({s.attention for knob, s in moves if knob == "attention"}
                | {s.experts for knob, s in moves if knob == "experts"})

    on_cpu = replace(FACTS, cuda=False)
    assert not offered(on_cpu, start) & {"varlen", "flex", "grouped_mm"}
    bf16 = start.model_copy(update={"precision": "bf16"})
    assert {"varlen", "flex", "grouped_mm"} <= offered(FACTS, bf16)
    fp32 = start.model_copy(update={"precision": "fp32"})
    assert "grouped_mm" not in offered(FACTS, fp32) and "varlen" in offered(FACTS, fp32)
    # a model with attention sinks (gpt-oss): flash varlen has no sink term (attention.py refuses it), flex has
    sinks = replace(FACTS, attention_sinks=True)
    assert "varlen" not in offered(sinks, bf16) and "flex" in offered(sinks, bf16)


def test_the_knob_table_is_the_space(start_yaml):
    """Every Settings field is one knob of the table; a knob with a recipe path sets exactly that performance-only
    field; each knob's values, set on the start one at a time, change only its own fields."""
    import dataclasses

    start, facts = load_recipe(start_yaml), FACTS
    assert set(space.KNOBS) == {f.name for f in dataclasses.fields(space.Settings)}
    base = space.start_settings(start, facts)
    assert candidate_recipe(start, base, facts).changes == {}  # reading and writing the start agree
    for knob in space.KNOB_TABLE:
        if knob.path:
            assert classify(knob.path).kind == PERFORMANCE, knob.path
            assert getattr(base, knob.name) == space._read(start, knob.path)
        for value in knob.values(start, facts, base):
            if value == getattr(base, knob.name):
                continue
            try:
                changes = candidate_recipe(start, replace(base, **{knob.name: value}), facts).changes
            except ValueError:
                continue  # a value the recipe refuses on its own (checked where the search prunes it)
            if knob.path:
                assert set(changes) == {knob.path}, (knob.name, changes)
            else:
                assert changes and all(path.split(".")[0] in ("layout", "recompute") for path in changes), changes
    ranked = {knob.name for knob in space.KNOB_TABLE if knob.first}
    assert ranked == {"layout", "rows", "recompute", "offload", "compile", "allocator"}


def test_a_caching_start_ranks_expandable_segments_on_gpus_only(start_yaml):
    """Expandable segments never reserve more than the caching allocator: on GPUs every first-ranked candidate of a
    caching start uses them (and no candidate goes back); on CPU, where the setting does nothing, it stays."""
    start = load_recipe(start_yaml).model_copy(update={"kernels": Kernels(allocator="caching")})
    for cuda, expected in ((True, {"expandable"}), (False, {"caching"})):
        facts = replace(FACTS, cuda=cuda)
        first = list(itertools.islice(space.first_ranking_space(start, facts), 50))
        assert first and {s.allocator for s in first} == expected
        moves = [s for knob, s in space.neighbours(space.start_settings(start, facts), start, facts)
                 if knob == "allocator"]
        assert [s.allocator for s in moves] == (["expandable"] if cuda else [])
        if cuda:
            assert candidate_recipe(start, moves[0], facts).changes == {"kernels.allocator": "expandable"}
