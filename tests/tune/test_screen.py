"""`openrecipes tune --screen`: candidates screened by ranks measured alone before any trial of the fleet. With a
synthetic rank measurer and runner: the pruned candidate carries its measured reason and never runs, the kept ones
carry their figures, and the card keeps the one-rank figures apart from the fleet's. For real (subprocesses under
the fake process group, on CPU): `--gpus 4xH200` on a machine without that fleet screens only."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from openrecipes.cards.validate import validate_file
from openrecipes.config.recipe import load_recipe
from openrecipes.tune.progress import Progress
from openrecipes.tune.publish import publish
from openrecipes.tune.search import Search, TuneOptions
from openrecipes.tune.verification import choose_winner

from .conftest import SyntheticRunner, write_start

BUDGET_GIB = 1.0  # one device; 5 % left free: a rank may peak at 0.95 GiB
HEAVY_GIB, LIGHT_GIB = 2.0, 0.5


class SyntheticMeasurer:
    """A rank record as train/rank_measure.py writes one on CPU: four rows per microbatch peak at HEAVY_GIB."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def measure(self, recipe_path: Path, rank: int, world: int, out: Path) -> dict:
        recipe = load_recipe(recipe_path)
        self.calls.append((recipe_path.parent.name, rank, world))
        heavy = recipe.layout.max_tokens_per_gpu >= 4 * 256
        return {"rank": rank, "world_size": world, "device": "cpu", "pp_rank": 0, "dp_rank": rank, "steps": 3,
                "timed_steps": 2, "parameters": {"dense": 10, "experts": 20}, "microbatches": 2,
                "rows_per_microbatch": 1, "row_tokens": 256,
                "phases_s": {"forward": 0.01, "backward": 0.02, "optimizer": 0.005}, "loss": [7.0] * 3,
                "grad_norm": [1.0] * 3, "expert_rows_received": [],
                "peak_rss_gib": HEAVY_GIB if heavy else LIGHT_GIB}


def _search(start: Path, out: Path, runner, measurer, *, screen: int = 6, trials: int = 5) -> Search:
    options = TuneOptions(start=start, out=out, gpus="cpu", trials=trials, minutes=60, trial_steps=8, screen=screen,
                          gpu_memory_gib=BUDGET_GIB)
    search = Search(options, runner, Progress(trials=trials, minutes=60, stream=io.StringIO()))
    search.rank_measurer = measurer
    return search


def test_screen_prunes_by_measured_rank_and_the_card_keeps_one_rank_figures_apart(tmp_path, rows_dir):
    start = write_start(tmp_path / "start.yaml", rows_dir)
    out, runner, measurer = tmp_path / "out", SyntheticRunner(), SyntheticMeasurer()
    result = _search(start, out, runner, measurer).run()
    screened = [json.loads(line) for line in (out / "screen.jsonl").read_text().splitlines()]
    assert measurer.calls and screened[0]["key"] == "start" and len(screened) == 7  # the start and six candidates
    pruned_keys = {r["key"] for r in screened if not r["fits"]}
    assert pruned_keys and any(r["fits"] for r in screened[1:])
    for record in screened:  # the reason is the measurement; the kept ones carry their figures
        assert record["fits"] == (record["peak_gib"] == LIGHT_GIB)
        assert (record["reason"] or "").startswith("" if record["fits"] else f"measured rank 0 peak {HEAVY_GIB:.3f} "
                                                                             "GiB > 0.950 GiB")
        assert all(r["measured_compute_s"] == 0.03 and "predicted" in r for r in record["ranks"])
    # pruned with its reason, as the planner's prunes are, and never run on the fleet
    pruned = {p["key"]: p for p in map(json.loads, (out / "pruned.jsonl").read_text().splitlines())}
    for key in pruned_keys:
        assert pruned[key]["reason"].startswith("measured rank 0 peak")
    run = {r["key"] for r in result.records}
    assert not run & pruned_keys
    assert runner.calls  # the trials still ran, on the fleet (here the synthetic runner)

    winner, failed = choose_winner(result)
    published = publish(result, winner, failed, minutes=0.5)
    loaded, problems = validate_file(published.card)
    assert loaded is not None and not [p for p in problems if p.severity == "error"], problems
    screen = loaded.card.tuning.screen
    assert screen.measured_on == "one rank" and screen.peak == "process_resident" and screen.world_size == 2
    assert len(screen.candidates) == len(screened)
    trials = {t.trial for t in loaded.card.tuning.trials}
    for entry, record in zip(screen.candidates, screened):
        assert entry.fits == record["fits"] and entry.ranks[0].peak_gib == record["peak_gib"]
        assert entry.trial is None or entry.trial in trials
    assert screen.candidates[0].trial == 0  # the start, screened and then run as trial 0
    assert "the figures under tuning.screen" in loaded.card.notes and "whole fleet" in loaded.card.notes
    # a screened candidate names a trial of the card, or the card does not validate
    import yaml

    tree = yaml.safe_load(published.card.read_text())
    tree["tuning"]["screen"]["candidates"][0]["trial"] = 99
    edited = tmp_path / "edited" / published.card.name
    edited.parent.mkdir()
    edited.write_text(yaml.safe_dump(tree, sort_keys=False))
    _, problems = validate_file(edited)
    assert any("trial 99 is not one of tuning.trials" in str(p) for p in problems), problems


def test_without_screen_nothing_is_measured_alone(tmp_path, rows_dir):
    start = write_start(tmp_path / "start.yaml", rows_dir)
    out, measurer = tmp_path / "out", SyntheticMeasurer()
    result = _search(start, out, SyntheticRunner(), measurer, screen=0, trials=2).run()
    assert not measurer.calls and result.screen is None and not (out / "screen.jsonl").exists()


def test_a_rerun_reuses_the_screen(tmp_path, rows_dir):
    start = write_start(tmp_path / "start.yaml", rows_dir)
    out, first = tmp_path / "out", SyntheticMeasurer()
    _search(start, out, SyntheticRunner(), first, screen=2, trials=2).run()
    again = SyntheticMeasurer()
    result = _search(start, out, SyntheticRunner(), again, screen=2, trials=2).run()
    assert first.calls and not again.calls and len(result.screen) == 3


HEAVY_TRY = "layout.pp=2 layout.dp=2 layout.max_tokens_per_gpu=512"  # its last stage: two rows of logits a microbatch


def test_screen_only_on_a_machine_without_the_fleet_prunes_by_real_measured_ranks(tmp_path):
    """`--gpus 4xH100` on CPU: each rank built and run alone under the fake process group. At a vocabulary of 131,072
    the start's rank peaked at 0.93-0.95 GiB resident on two cores, the given candidate's last stage (two rows of
    logits per microbatch, two microbatches in flight) at 1.52 GiB: a budget of 1.25 GiB (1.19 with 5 % free) keeps one and prunes the other.
    H100, not H200: the H200's compile prior ranks compiled candidates first, whose compile on CPU takes minutes."""
    import pytest
    import torch
    import yaml

    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine holds the fleet: the tuner would run trials, not screen only")
    tree = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml").read_text())
    tree.update(model_overrides={"vocab_size": 131072}, checkpoint={"every": None}, run_dir=str(tmp_path / "run"),
                recompute={"granularity": "none"})
    tree["layout"]["max_tokens_per_gpu"] = 256
    start = tmp_path / "start.yaml"
    start.write_text(yaml.safe_dump(tree))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "openrecipes", "tune", str(start), "--gpus", "4xH100", "--screen", "1",
               "--gpu-memory-gib", "1.25", "--try", HEAVY_TRY, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "screening only, no trial" in done.stderr
    result = json.loads((out / "tune.json").read_text())["result"]
    assert result["outcome"] == "screened"
    screen = result["screen"]
    assert screen["measured_on"] == "one rank" and screen["peak"] == "process_resident" and screen["world_size"] == 4
    by_changes = {c["changes"]: c for c in screen["candidates"]}
    heavy = by_changes["layout.dp=2, layout.max_tokens_per_gpu=512, layout.pp=2"]
    assert not heavy["fits"] and heavy["reason"].startswith("measured rank 2 peak ")
    assert [r["rank"] for r in heavy["ranks"]] == [0, 2]  # the first rank of each pipeline stage
    kept = [c for c in screen["candidates"] if c["fits"]]
    assert by_changes["the starting point"]["fits"] and kept
    for candidate in screen["candidates"]:  # every screened one carries its measured figures
        assert all(r["peak_gib"] > 0 and r["compute_s"] > 0 for r in candidate["ranks"])
    pruned = [json.loads(line) for line in (out / "pruned.jsonl").read_text().splitlines()]
    assert any(p["label"] == heavy["changes"] and p["reason"] == heavy["reason"] for p in pruned)
    assert not (out / "trials.jsonl").exists()  # no trial of the fleet
    screened = load_recipe(out / "screened.yaml")
    assert screened.layout.pp == 1 and result["best"] in by_changes and by_changes[result["best"]]["fits"]


class FailingMeasurer(SyntheticMeasurer):
    """A rank this machine cannot measure (its process fails): four rows per microbatch."""

    def measure(self, recipe_path: Path, rank: int, world: int, out: Path) -> dict:
        if load_recipe(recipe_path).layout.max_tokens_per_gpu >= 4 * 256:
            raise ValueError(f"rank {rank}: the measuring process failed: out of memory")
        return super().measure(recipe_path, rank, world, out)


def test_a_candidate_that_cannot_be_measured_here_is_left_to_the_planner(tmp_path, rows_dir):
    start = write_start(tmp_path / "start.yaml", rows_dir)
    out = tmp_path / "out"
    result = _search(start, out, SyntheticRunner(), FailingMeasurer(), screen=6, trials=2).run()
    screened = [json.loads(line) for line in (out / "screen.jsonl").read_text().splitlines()]
    assert screened and all(r["fits"] for r in screened) and len(result.screen) == len(screened) < 7
    pruned = (out / "pruned.jsonl").read_text()
    assert "measured rank" not in pruned  # unmeasured is not pruned
