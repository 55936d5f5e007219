"""`openrecipes tune` for real: the tiny model over two gloo processes from a deliberately slow start (full recompute,
one row per microbatch), an injected crash, and a rerun that reuses every finished trial. Several minutes on CPU."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import markupsafe
import pytest

from openrecipes.cards.validate import validate_file
from openrecipes.config.recipe import load_recipe
from openrecipes.verify.rules import compare_recipes

from .conftest import write_start

pytestmark = pytest.mark.slow


def _tune(start, out, *extra):
    command = [sys.executable, "-m", "openrecipes", "tune", str(start), "--gpus", "cpu", "--trials", "4",
               "--trial-steps", "8", "--minutes", "20", "--out", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_tune_finds_a_faster_verified_recipe_on_two_processes(tmp_path):
    start = write_start(tmp_path / "start.yaml")  # data.build: the tuner builds the rows once
    out = tmp_path / "out"
    result = _tune(start, out, "--try", "debug.fail_at=[1,3]")
    assert result.returncode == 0, result.stderr[-4000:]
    every = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    records = [r for r in every if r["phase"] not in ("remeasure", "ablation")]
    assert len(records) == 4
    # before the card: start and winner twice more, in turns
    assert [r["key"].split("-")[1] == "start" for r in every if r["phase"] == "remeasure"] == [True, False] * 2
    crash = records[1]
    assert crash["failure"]["class"] == "crash" and "injected failure" in crash["failure"]["detail"]
    measured = [r for r in records if r["status"] == "ok"]
    assert len(measured) >= 2  # the search went on after the crash
    start_tps = records[0]["measured"]["tokens_per_s_per_gpu"]
    best = max(r["measured"]["tokens_per_s_per_gpu"] for r in measured)
    # a real CPU timing on a shared machine of two cores, where two processes train: above run-to-run noise (a few
    # %), below what the moves away from full recompute and one row per microbatch give (1.14x to above 1.5x seen);
    # the card below is written only once the interleaved remeasurement puts the gain outside its spread
    assert best > 1.05 * start_tps, records
    assert not any(r["changes"].get("kernels.experts") == "grouped_mm" for r in records)  # CUDA only

    card_path = out / "recipes" / "qwen3-moe-tiny" / "cpu" / "slow-start-tuned.yaml"
    loaded, problems = validate_file(card_path)
    assert loaded is not None and not [p for p in problems if p.severity == "error"], problems
    assert loaded.card.status == "verified" and loaded.card.correctness.convergence.result == "pass"
    gain = loaded.card.tuning.gain
    # the card's result is the tuned figure: the median of the winner's samples, its search trial first
    assert gain.winner_tokens_per_s_per_gpu[0] == best and loaded.card.result.runs == len(gain.winner_tokens_per_s_per_gpu)
    assert loaded.card.result.tokens_per_s_per_gpu == loaded.card.tuning.tuned_tokens_per_s_per_gpu
    assert len(gain.pair_gains) == 3 and min(gain.pair_gains) > 0 and gain.median_gain > gain.start_spread
    assert compare_recipes(load_recipe(out / "tuned.yaml"), load_recipe(start)).passed
    assert 'id="tuning-chart"' in (out / "site" / "qwen3-moe-tiny" / "cpu" / "slow-start-tuned.html").read_text()
    # one set of figures: the console's closing line, the card's tuning block and notes, the site's summary
    tuning, page = loaded.card.tuning, (out / "site" / "qwen3-moe-tiny" / "cpu" / "slow-start-tuned.html").read_text()
    headline = (f"openrecipes tune: {tuning.start_tokens_per_s_per_gpu:,.1f} -> {tuning.tuned_tokens_per_s_per_gpu:,.1f}"
                f" tokens/s/GPU, gain {gain.describe()}, verified, {tuning.minutes:.1f} of ")
    assert headline in result.stdout, (headline, result.stdout)
    assert gain.describe() in loaded.card.notes and str(markupsafe.escape(gain.describe())) in page
    assert f'id="metric-tokens">{tuning.tuned_tokens_per_s_per_gpu:,.1f}<' in page  # the page's headline too
    assert f"{len(tuning.trials)} trials in {tuning.minutes:.1f} minutes" in loaded.card.notes
    recorded = json.loads((out / "tune.json").read_text())["result"]  # and tune.json, beside the settings
    assert recorded["gain"] == gain.model_dump() and recorded["gain_text"] == gain.describe()
    assert (recorded["start_tokens_per_s_per_gpu"], recorded["tuned_tokens_per_s_per_gpu"], recorded["minutes"],
            recorded["trials"]) == (tuning.start_tokens_per_s_per_gpu, tuning.tuned_tokens_per_s_per_gpu,
                                    tuning.minutes, len(tuning.trials))

    mtimes = {p: p.stat().st_mtime_ns for p in (out / "trials").rglob("metrics.jsonl")}
    again = _tune(start, out, "--try", "debug.fail_at=[1,3]")
    assert again.returncode == 0, again.stderr[-4000:]
    # every record reused (an ablation that equals a search trial is reused twice), nothing trained again
    assert again.stderr.count("reused from trials.jsonl") >= len(every)
    assert not re.search(r"\[\d+ s[,\]]", again.stderr)
    assert {p: p.stat().st_mtime_ns for p in (out / "trials").rglob("metrics.jsonl")} == mtimes
    assert (out / "trials.jsonl").read_text().splitlines() == [json.dumps(r, sort_keys=True) for r in every]
