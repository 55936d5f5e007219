"""The memory margin a ranked candidate keeps: 5 % until trials measured how far off the refitted model's peaks are,
then what they warrant (never below 2 %), and the solved offload fraction moving with it (synthetic runners)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from openrecipes.config.recipe import load_recipe
from openrecipes.tune.predict import MARGIN_ALLOWANCE, MEMORY_MARGIN, MIN_MEMORY_MARGIN, refined_margin
from openrecipes.tune.progress import Progress
from openrecipes.tune.search import Search, TuneOptions
from openrecipes.tune.solve import solved_offload
from openrecipes.tune.space import start_settings
from openrecipes.tune.trial import peak_under_prediction

from .conftest import SyntheticRunner


def test_the_margin_is_the_worst_measured_error_within_its_bounds():
    assert refined_margin([]) == MEMORY_MARGIN
    assert refined_margin([-0.03, 0.001]) == MIN_MEMORY_MARGIN  # predicted well: the floor, not less
    assert refined_margin([0.005, 0.025]) == pytest.approx(0.025 + MARGIN_ALLOWANCE)
    assert refined_margin([0.2]) == MEMORY_MARGIN  # far off: the out-of-memory bound's business, not the margin's


def _record(status="ok", reserved=100.0, expected=101.0, fitted_on=1, failure=None):
    measured = {"peak_reserved_gib": reserved} if status == "ok" else None
    return {"status": status, "failure": failure, "measured": measured,
            "prediction": {"calibrated_peak_gib": expected, "capacity_gib": 140.0, "context_gib": 0.6,
                           "calibration": {"fitted_on": fitted_on}}}


def test_a_trials_under_prediction_is_measured_against_what_the_search_expected():
    assert peak_under_prediction(_record(reserved=110.0, expected=103.6)) == pytest.approx(7.0 / 140.0)
    assert peak_under_prediction(_record(reserved=100.0, expected=110.0)) < 0  # over-predicted
    assert peak_under_prediction(_record(fitted_on=0)) is None  # the start: predicted before any measurement
    assert peak_under_prediction(_record(reserved=None)) is None  # nothing measured (a CPU trial)
    out = _record(status="failed", expected=133.0, failure={"class": "out_of_memory", "detail": "x"})
    assert peak_under_prediction(out) == pytest.approx(7.0 / 140.0)  # all it left free was not enough
    crash = _record(status="failed", failure={"class": "crash", "detail": "x"})
    assert peak_under_prediction(crash) is None


def test_peaks_measured_as_predicted_lower_the_margin_and_the_solved_fraction(start_yaml, tmp_path):
    stream = io.StringIO()
    options = TuneOptions(start=start_yaml, out=tmp_path / "out", gpus="cpu", trials=6, minutes=60, trial_steps=8)
    search = Search(options, SyntheticRunner(), Progress(trials=6, minutes=60, stream=stream))
    planner_predict = search.planner.predict

    def predict(recipe):  # a memory model where offload binds: 110 GiB without, 40 GiB less wholly offloaded
        allocated = 110.0 - 40.0 * recipe.offload.fraction
        return replace(planner_predict(recipe), allocated_gib=allocated, peak_reserved_gib=allocated + 0.6,
                       capacity_gib=100.0, context_gib=0.6)

    def peaks(recipe):  # and the trials measure exactly that
        allocated = predict(recipe).allocated_gib
        return allocated, allocated

    search.planner.predict, search.runner.peaks = predict, peaks
    base = start_settings(search.start, search.facts)
    assert solved_offload(base, search._fits).offload == 0.4  # 5 % of 100 GiB free: 110 - 40 f + 0.6 <= 95
    search.run()
    assert search.calibration.memory_margin == MIN_MEMORY_MARGIN
    assert "memory margin now 2 % of the device" in stream.getvalue()
    assert solved_offload(base, search._fits).offload == 0.35  # 2 % free: <= 98
    # the first ranking was solved again under the refined margin: 0.35 ran in that phase, though at 5 % it was
    # predicted not to fit, and nothing below it ran
    offloads = [(r["phase"], load_recipe(search.out / r["run_dir"] / "recipe.yaml").offload.fraction)
                for r in search.journal.records if r["phase"] != "start"]
    assert ("ranked", 0.35) in offloads and min(f for _, f in offloads) == 0.35


def test_under_expandable_segments_a_measured_reserve_is_not_a_need():
    from openrecipes.tune.predict import Calibration, Prediction

    def prediction(expandable):
        return Prediction(tokens_per_s_per_gpu=1.0, step_time_s=1.0, layer_microbatches=1, allocated_gib=130.0,
                          peak_reserved_gib=130.0 * 1.015 + 0.6, capacity_gib=140.4, context_gib=0.6,
                          expandable=expandable)

    measured = Calibration(reserve_ratio=(1.06, 1.06))  # what trials kept above their allocated peak
    assert measured.peak_gib(prediction(False)) == pytest.approx(130.0 * 1.06 + 0.6)
    assert measured.peak_gib(prediction(True)) == pytest.approx(130.0 * 1.015 + 0.6)  # the planner's, at the edge
    record = {"status": "ok", "measured": {"peak_memory_gib": 131.4, "peak_reserved_gib": 136.0},
              "prediction": {**prediction(True).to_dict(), "calibrated_peak_gib": 132.55,
                             "calibrated_allocated_gib": 130.0, "calibration": {"fitted_on": 1}}}
    assert peak_under_prediction(record) == pytest.approx(1.4 / 140.4)  # allocated against allocated
