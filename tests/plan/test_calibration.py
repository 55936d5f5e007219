"""The planner's engine model against our measured H200 runs (bench/results) and planner.yaml's fitted numbers."""

from dataclasses import asdict
from pathlib import Path

import pytest

from openrecipes.plan.calibration import FITTED_ON, compare, fit_engine_calibration, measured_runs
from openrecipes.plan.hardware import load_hardware

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@pytest.fixture(scope="module")
def comparisons():
    return compare(measured_runs(RESULTS), load_hardware("H200"))


def test_hardware_yaml_holds_the_numbers_the_measurements_fit():
    hw = load_hardware("H200")
    fitted = fit_engine_calibration(measured_runs(RESULTS), hw)
    for name, value in asdict(fitted).items():
        assert getattr(hw.openrecipes_engine, name) == pytest.approx(value, rel=0.01), name


def test_fitted_runs_are_reproduced(comparisons):
    fitted = [c for c in comparisons if c.fitted]
    assert sorted(c.run.variant for c in fitted) == sorted(FITTED_ON.values())
    for c in fitted:
        assert abs(c.throughput_error) < 0.01, c.run.variant


def test_held_out_speeds(comparisons):
    held_out = {c.run.variant: c.throughput_error for c in comparisons
                if not c.fitted and c.throughput_error is not None}
    # data and expert parallel runs at 8 layers, one row per GPU: within 7 %
    for variant in ("single_bal", "dp2_bal", "dp2_pa_bal", "dp2ep2_pa_bal", "dp4ep4_pa_bal", "dp4ep2_pa_bal"):
        assert abs(held_out[variant]) < 0.07, (variant, held_out[variant])
    # packed short documents (attention modeled as row-long), TP with DP and EP, and 48 layers at 16k tokens/GPU
    # are the model's known weak spots: within 20 % (docs/plan.md)
    for variant in ("packed_bal", "tp2dp2ep4_pa_bal", "seed48_dp4ep4_pa_bal"):
        assert abs(held_out[variant]) < 0.20, (variant, held_out[variant])


def test_training_peaks(comparisons):
    errors = {(c.run.source, c.run.variant): c.memory_error for c in comparisons if c.memory_error is not None}
    assert len(errors) >= 12
    worst = max(errors.items(), key=lambda item: abs(item[1]))
    assert abs(worst[1]) <= 0.10, worst
    # one microbatch on one stage, gradients larger than the logits: the peak is the end of the backward, without the
    # fixed overhead (stacked on the gradients, these were +4.8 % to +9.9 %)
    by_variant = {variant: error for (_, variant), error in errors.items()}
    for variant in ("single_bal", "dp2_bal", "dp2ep2_bal", "tp2_pa_bal", "cp2_pa_bal"):
        assert abs(by_variant[variant]) < 0.05, (variant, by_variant[variant])
