"""`openrecipes verify convergence` on crafted loss curves."""

import json
import math
import random
import xml.etree.ElementTree as ET

import pytest

import openrecipes.cli as cli
from openrecipes.verify.convergence import Thresholds, check_convergence
from openrecipes.verify.curves import LossCurve, read_loss_curve

STEPS = 20


def base(step):
    return 9.0 * math.exp(-step / 6.0) + 1.5  # from 10.5 down to ~1.8, crossing the 2.0 band edge


def curve(values, name="curve"):
    return LossCurve(source=name, losses=dict(enumerate(values)))


def write_jsonl(path, losses):
    path.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
    return path


def write_csv(path, losses):
    path.write_text("step,loss\n" + "".join(f"{s},{'' if v is None else v}\n" for s, v in losses.items()))
    return path


@pytest.fixture
def run_cli(monkeypatch):
    monkeypatch.setattr(cli, "VERB_MODULES", {"verify": "openrecipes.verify.cli"})
    return cli.main


REFERENCE = [base(s) for s in range(STEPS)]


def reject_constant(name):
    raise AssertionError(f"output is not strict JSON: bare {name}")


def check_names(report):
    return {c.name: c.passed for c in report.checks}


def test_identical_curves_pass():
    report = check_convergence(curve(REFERENCE), curve(REFERENCE))
    assert report.passed
    assert report.correlation == pytest.approx(1.0)
    assert report.final_loss_difference == 0.0
    assert report.pointwise_failures == 0
    assert report.skipped_steps == [0, 1, 2, 3]  # the first 20 % of 20 steps
    assert report.compared_steps == list(range(4, STEPS))


def test_ten_percent_shift_fails():
    report = check_convergence(curve([v * 1.10 for v in REFERENCE]), curve(REFERENCE))
    assert not report.passed
    checks = check_names(report)
    # a uniform shift keeps the shape: only the magnitude checks catch it
    assert checks["correlation"] and checks["outliers"]
    assert not checks["pointwise"] and not checks["final_loss"]
    assert report.final_loss_difference == pytest.approx(0.10)


def test_small_noise_within_tolerance_passes():
    rng = random.Random(0)
    noisy = [v * (1 + rng.uniform(-0.003, 0.003)) for v in REFERENCE]
    report = check_convergence(curve(noisy), curve(REFERENCE))
    assert report.passed, report.checks
    assert 0.999 < report.correlation < 1.0


def test_one_nan_fails_and_is_named():
    values = list(REFERENCE)
    values[11] = float("nan")
    report = check_convergence(curve(values), curve(REFERENCE))
    assert not report.passed
    assert not check_names(report)["finite"]
    assert any("step 11: candidate loss is nan" in p for p in report.problems)
    # the other checks still run on the remaining points
    assert 11 not in report.compared_steps and check_names(report)["correlation"]


def test_nan_in_warm_up_still_fails():
    values = list(REFERENCE)
    values[0] = float("inf")
    report = check_convergence(curve(REFERENCE), curve(values))
    assert not report.passed
    assert any("step 0: reference loss is inf" in p for p in report.problems)


def test_one_missing_step_fails_and_is_named():
    losses = dict(enumerate(REFERENCE))
    del losses[9]
    report = check_convergence(LossCurve(source="c", losses=losses), curve(REFERENCE))
    assert not report.passed
    assert not check_names(report)["steps"]
    assert "step 9: missing on the candidate (present on the reference)" in report.problems


def test_gap_on_both_sides_fails():
    losses = {s: v for s, v in enumerate(REFERENCE) if s != 14}
    report = check_convergence(LossCurve(source="c", losses=losses), LossCurve(source="r", losses=dict(losses)))
    assert not report.passed
    assert "step 14: missing on both sides (gap in the step sequence)" in report.problems


def test_final_loss_divergence_alone_fails():
    values = list(REFERENCE)
    values[-1] *= 1.08  # one pointwise failure out of 16 is under the 10 % share
    report = check_convergence(curve(values), curve(REFERENCE))
    checks = check_names(report)
    assert checks["pointwise"] and not checks["final_loss"] and not report.passed


def test_thresholds_are_options():
    shifted = curve([v * 1.10 for v in REFERENCE])
    loose = Thresholds(high_loss_tolerance=0.2, medium_loss_tolerance=0.2, final_loss_tolerance=0.2)
    assert check_convergence(shifted, curve(REFERENCE), loose).passed
    with pytest.raises(ValueError, match="skip_first_fraction"):
        Thresholds(skip_first_fraction=1.5)


def test_tolerance_band_follows_the_reference_value():
    t = Thresholds()
    assert [t.pointwise_tolerance(x) for x in (2.5, 2.0, 1.0, 0.5, 0.1)] == [0.10, 0.05, 0.05, 0.02, 0.02]


def test_flat_curves_fail_correlation_instead_of_passing_on_nan():
    report = check_convergence(curve([2.0] * STEPS), curve([2.0] * STEPS))
    assert not check_names(report)["correlation"] and not report.passed


def test_csv_and_jsonl_inputs_are_read_alike(tmp_path):
    losses = dict(enumerate(REFERENCE))
    a = read_loss_curve(write_csv(tmp_path / "ref.csv", losses))
    b = read_loss_curve(write_jsonl(tmp_path / "ref.jsonl", losses))
    assert a.losses == b.losses == losses


def test_csv_blank_loss_and_nan_are_findings(tmp_path):
    losses = dict(enumerate(REFERENCE))
    losses[5], losses[6] = None, float("nan")
    got = read_loss_curve(write_csv(tmp_path / "c.csv", losses))
    assert got.losses[5] is None and math.isnan(got.losses[6])


def test_run_dir_input(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": v, "step_time_s": 1.0}) + "\n" for s, v in enumerate(REFERENCE)))
    assert read_loss_curve(run).losses == dict(enumerate(REFERENCE))


@pytest.mark.parametrize("text, message", [
    ("step,loss\n1,abc\n", "c.csv:2: 'loss' must be a number"),
    ("step,value\n1,2\n", "c.csv:1: CSV header must name a 'loss' column"),
    ("step,loss\n1,2\n1,3\n", "c.csv:3: step 1 repeats line 2"),
    ("step,loss\n-1,2\n", "c.csv:2: 'step' must be a non-negative integer"),
])
def test_bad_csv_names_file_and_line(tmp_path, text, message):
    path = tmp_path / "c.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_loss_curve(path)


def test_bad_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 1.0\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: malformed JSON"):
        read_loss_curve(path)
    path.write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1: missing field 'loss'"):
        read_loss_curve(path)


def test_cli_exit_status_json_and_plot(tmp_path, run_cli, capsys):
    ref = write_jsonl(tmp_path / "ref.jsonl", dict(enumerate(REFERENCE)))
    good = write_csv(tmp_path / "good.csv", dict(enumerate(REFERENCE)))
    shifted = write_csv(tmp_path / "bad.csv", {s: v * 1.1 for s, v in enumerate(REFERENCE)})
    svg = tmp_path / "plots" / "loss.svg"

    assert run_cli(["verify", "convergence", str(good), str(ref), "--plot", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "convergence: PASS" in out and "correlation" in out
    root = ET.fromstring(svg.read_text())  # well-formed XML
    polylines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert [p.get("class") for p in polylines] == ["reference", "candidate"]
    assert all(len(p.get("points").split()) == STEPS for p in polylines)

    assert run_cli(["verify", "convergence", str(shifted), str(ref), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is False
    assert {c["name"]: c["passed"] for c in data["checks"]}["final_loss"] is False

    # the threshold options reach the checks
    assert run_cli(["verify", "convergence", str(shifted), str(ref), "--final-loss-tolerance", "0.2",
                    "--high-loss-tolerance", "0.2", "--medium-loss-tolerance", "0.2"]) == 0
    capsys.readouterr()

    assert run_cli(["verify", "convergence", str(tmp_path / "none.csv"), str(ref)]) == 2
    assert "none.csv not found" in capsys.readouterr().err


def test_cli_names_nan_and_missing_steps(tmp_path, run_cli, capsys):
    losses = {s: v for s, v in enumerate(REFERENCE) if s != 3}
    losses[8] = float("nan")
    cand = write_jsonl(tmp_path / "c.jsonl", losses)
    ref = write_jsonl(tmp_path / "r.jsonl", dict(enumerate(REFERENCE)))
    assert run_cli(["verify", "convergence", str(cand), str(ref), "--json"]) == 1
    data = json.loads(capsys.readouterr().out, parse_constant=reject_constant)
    assert "step 3: missing on the candidate (present on the reference)" in data["problems"]
    assert "step 8: candidate loss is nan" in data["problems"]


def test_a_nan_the_trainer_wrote_fails_naming_its_step(tmp_path):
    from openrecipes.config.rundir import encode_metric
    from openrecipes.verify.curves import read_loss_curve

    for name, bad in (("cand", 6), ("ref", None)):
        lines = [json.dumps({"step": s, "loss": encode_metric(float("nan") if s == bad else 2.0 - 0.01 * s)})
                 for s in range(10)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    candidate = read_loss_curve(tmp_path / "cand.jsonl")
    report = check_convergence(candidate, read_loss_curve(tmp_path / "ref.jsonl"), Thresholds())
    assert not report.passed and any("step 6" in problem for problem in report.problems)
