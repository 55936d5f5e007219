"""`verify convergence` on curves logged every k steps: compared on the steps both have, gaps still named."""

import json
import math
import time

import pytest

import openrecipes.cli as cli
from openrecipes.verify.convergence import check_convergence
from openrecipes.verify.curves import LossCurve


def loss(step, total):
    return 8.0 * math.exp(-5.0 * step / total) + 1.8 + 0.05 * math.sin(step / 7.0)


def logged(total, every, *, last=True, noise=0.0, stop=None):
    """A run of ``total`` steps logged every ``every`` steps (and at its last step when ``last``)."""
    steps = list(range(0, total if stop is None else stop, every))
    if last and stop is None:
        steps.append(total - 1)
    return {s: loss(s, total) * (1 + noise * math.cos(s)) for s in sorted(set(steps))}


def check(candidate, reference):
    return check_convergence(LossCurve(source="c", losses=candidate), LossCurve(source="r", losses=reference))


def checks(report):
    return {c.name: c.passed for c in report.checks}


@pytest.mark.parametrize("candidate_every, reference_every", [(1, 1), (1, 10), (10, 1), (10, 10)])
def test_curves_at_intervals_one_and_ten_pass(candidate_every, reference_every):
    report = check(logged(1000, candidate_every, noise=0.002), logged(1000, reference_every))
    assert report.passed, report.checks
    assert report.intervals == {"candidate": candidate_every, "reference": reference_every}
    expected_common = len(logged(1000, max(candidate_every, reference_every)))
    assert report.common_steps == expected_common
    assert report.compared_steps[-1] == 999  # the final step is logged by both
    assert report.notes == []  # nothing past the reference's end


def test_thinned_30000_step_golden_against_a_full_curve():
    """Megatron-Bridge keeps long runs' golden curves thinned: every 100 steps of 30,000."""
    golden = logged(30_000, 100)
    started = time.perf_counter()
    report = check(logged(30_000, 1, noise=0.002), golden)
    assert report.passed, report.checks
    assert report.common_steps == len(golden) == 301
    assert report.intervals == {"candidate": 1, "reference": 100}
    assert len(report.skipped_steps) == 60 and report.skipped_steps[-1] == 5900
    assert time.perf_counter() - started < 5


def test_a_step_missing_from_the_middle_of_a_thinned_curve_fails():
    golden = logged(30_000, 100)
    del golden[15_000]
    report = check(logged(30_000, 1), golden)
    assert not report.passed and not checks(report)["steps"]
    assert "step 15000: missing on the reference (present on the candidate)" in report.problems


def test_a_gap_in_the_candidates_own_interval_fails_even_where_the_reference_has_no_step():
    candidate = logged(1000, 10)
    del candidate[500]
    report = check(candidate, logged(1000, 100))
    assert "step 500: missing on the candidate (present on the reference)" in report.problems
    candidate = logged(1000, 10)
    del candidate[510]
    report = check(candidate, logged(1000, 100))
    assert not report.passed
    assert "step 510: missing on the candidate (a gap in its log every 10 steps)" in report.problems


def test_a_step_off_the_interval_fails():
    reference = logged(1000, 10)
    reference[255] = loss(255, 1000)
    report = check(logged(1000, 1), reference)
    assert not report.passed
    assert any(p.startswith("step 255: off the reference's logging interval of 10 steps") for p in report.problems)


def test_nan_in_a_thinned_curve_fails():
    golden = logged(30_000, 100)
    golden[20_000] = float("nan")
    report = check(logged(30_000, 1), golden)
    assert not checks(report)["finite"] and "step 20000: reference loss is nan" in report.problems


def test_a_candidate_that_stops_early_fails():
    report = check(logged(30_000, 1, stop=12_345), logged(30_000, 100))
    assert not report.passed and not checks(report)["steps"]
    assert any("the candidate stops at step 12344" in p for p in report.problems)
    # one step short of the end, logged every 10: its next step (1000) would be past the reference's 999
    assert check(logged(1000, 10, last=False), logged(1000, 1)).passed


def test_a_candidate_past_the_reference_is_judged_on_the_common_steps_and_says_so():
    candidate = logged(2000, 1)
    reference = {s: candidate[s] for s in range(0, 1000, 10)}
    report = check(candidate, reference)
    assert report.passed, report.checks
    assert report.compared_steps[-1] == 990 and report.final_loss_difference == 0.0
    assert any("runs past the reference's last step 990 (to 1999)" in note for note in report.notes)


def test_huge_step_numbers_are_judged_arithmetically():
    """A gap of 10**15 steps is named as a range; nothing is allocated per step."""
    reference = logged(1000, 10)
    candidate = dict(reference)
    candidate[10**15] = 2.0  # far past the reference's end
    started = time.perf_counter()
    report = check(candidate, reference)
    assert time.perf_counter() - started < 2
    assert any("more missing on the candidate" in p for p in report.problems)
    gap = {999: 2.0, 10**15: 2.0, 2 * 10**15: 2.0, 3 * 10**15: 2.5}
    report = check({0: 3.0, **gap}, {0: 3.0, **gap})
    assert report.intervals["reference"] == 10**15


def test_cli_reports_intervals_and_notes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "VERB_MODULES", {"verify": "openrecipes.verify.cli"})
    candidate, reference = tmp_path / "c.jsonl", tmp_path / "r.csv"
    candidate.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in logged(3000, 1).items()))
    reference.write_text("step,loss\n" + "".join(f"{s},{v}\n" for s, v in logged(2000, 1).items() if s % 100 == 0))
    assert cli.main(["verify", "convergence", str(candidate), str(reference)]) in (0, 1)
    out = capsys.readouterr().out
    assert "logged every 1 (candidate) and 100 (reference)" in out
    assert "note: the candidate runs past the reference's last step 1900" in out
    assert cli.main(["verify", "convergence", str(candidate), str(reference), "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["intervals"] == {"candidate": 1, "reference": 100} and data["common_steps"] == 20
