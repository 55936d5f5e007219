"""Convergence check: does a candidate loss curve follow a reference one?

The statistical checks follow Megatron-Bridge's ``validate_convergence`` with its pipeline
defaults (docs/verify.md): Pearson correlation, pointwise relative difference with a
tolerance chosen by the reference value, final-loss relative difference, and the share of
3-sigma outliers of the difference. As there, they run on the steps both curves have (each may
be logged every k steps: ``verify.steps``), and the first ``skip_first_fraction`` of those is
left out of the correlation, pointwise and outlier checks (the final step is never in it).

Unlike there, a curve with a NaN, infinite or absent loss, a step missing from the middle of
one curve's own logging interval, or a candidate that stops before the reference's end fails,
and each such step is named. All steps, warm-up included, are held to that.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from openrecipes.verify.curves import LossCurve, is_finite
from openrecipes.verify.steps import compare_steps

SHOWN_FAILURES = 5  # pointwise failures listed by step; the count covers all of them


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    correlation: float = 0.95
    high_loss_tolerance: float = 0.10  # reference loss > high_loss_above
    medium_loss_tolerance: float = 0.05  # reference loss > medium_loss_above
    low_loss_tolerance: float = 0.02  # otherwise
    high_loss_above: float = 2.0
    medium_loss_above: float = 0.5
    final_loss_tolerance: float = 0.05
    max_outlier_ratio: float = 0.1  # for both pointwise failures and 3-sigma outliers
    outlier_sigma: float = 3.0
    skip_first_fraction: float = 0.2

    def __post_init__(self) -> None:
        if not -1.0 <= self.correlation <= 1.0:  # nan too: a threshold nothing passes, or one everything passes
            raise ValueError(f"correlation must be in [-1, 1], got {self.correlation}")
        if not 0.0 <= self.skip_first_fraction < 1.0:
            raise ValueError(f"skip_first_fraction must be in [0, 1), got {self.skip_first_fraction}")
        for name in ("high_loss_tolerance", "medium_loss_tolerance", "low_loss_tolerance",
                     "final_loss_tolerance", "max_outlier_ratio", "outlier_sigma"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value}")

    def pointwise_tolerance(self, reference: float) -> float:
        if reference > self.high_loss_above:
            return self.high_loss_tolerance
        if reference > self.medium_loss_above:
            return self.medium_loss_tolerance
        return self.low_loss_tolerance


@dataclass(kw_only=True)
class Check:
    name: str
    passed: bool
    value: float | None
    limit: str
    detail: str = ""


@dataclass(kw_only=True)
class ConvergenceReport:
    passed: bool
    candidate: str
    reference: str
    steps: list[int]  # every step seen on either side
    skipped_steps: list[int]  # warm-up steps (of the common ones) left out of the statistical checks
    compared_steps: list[int]  # common steps after the skip, finite on both sides
    checks: list[Check]
    problems: list[str] = field(default_factory=list)  # each NaN / missing / gap, by step
    common_steps: int = 0  # how many steps both curves have
    intervals: dict[str, int | None] = field(default_factory=dict)  # each curve's logging interval
    notes: list[str] = field(default_factory=list)  # e.g. candidate steps past the reference's end
    correlation: float | None = None
    final_loss_difference: float | None = None
    pointwise_failures: int | None = None
    outliers: int | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data; a non-finite number becomes its string ("inf", "nan")."""
        return _json_safe(asdict(self))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def relative_difference(candidate: float, reference: float) -> float:
    """|c − r| / |r|; a zero reference gives 0 when equal, else infinity (always over tolerance)."""
    if reference == 0.0:
        return 0.0 if candidate == 0.0 else math.inf
    return abs(candidate - reference) / abs(reference)


def _fmt_steps(steps: list[int]) -> str:
    return ", ".join(str(step) for step in steps)


def _integrity(candidate: LossCurve, reference: LossCurve):
    """The steps and finite checks, the problems by step, and the step comparison (``verify.steps``)."""
    compared = compare_steps(set(candidate.losses), set(reference.losses))
    problems = list(compared.problems)
    step_problems = len(problems)
    for side, curve in (("candidate", candidate), ("reference", reference)):
        for step in curve.steps():
            value = curve.losses[step]
            if not is_finite(value):
                problems.append(f"step {step}: {side} loss is {'absent (null)' if value is None else value}")
    nonfinite = len(problems) - step_problems
    cand, ref = compared.candidate, compared.reference
    shape = (f"candidate {len(cand.steps)} steps {cand.first}-{cand.last} every {cand.interval or '-'}, reference "
             f"{len(ref.steps)} steps {ref.first}-{ref.last} every {ref.interval or '-'}; "
             f"{len(compared.common)} common")
    checks = [
        Check(name="steps", passed=step_problems == 0, value=float(step_problems), limit="none missing",
              detail=shape if step_problems == 0 else f"{shape}; "
              + "; ".join(problems[:min(step_problems, SHOWN_FAILURES)])
              + (" ..." if step_problems > SHOWN_FAILURES else "")),
        Check(name="finite", passed=nonfinite == 0, value=float(nonfinite), limit="all finite",
              detail="" if nonfinite == 0 else "; ".join(problems[step_problems:])),
    ]
    return checks, problems, compared


def check_convergence(
    candidate: LossCurve, reference: LossCurve, thresholds: Thresholds | None = None
) -> ConvergenceReport:
    """Run every check; the report passes only when each of them does."""
    thresholds = thresholds or Thresholds()
    steps = sorted(set(candidate.losses) | set(reference.losses))
    if not steps:
        raise ValueError("both loss curves are empty")
    checks, problems, step_report = _integrity(candidate, reference)

    common = step_report.common
    skip = int(len(common) * thresholds.skip_first_fraction)
    skipped, kept = common[:skip], common[skip:]
    compared = [s for s in kept if is_finite(candidate.losses[s]) and is_finite(reference.losses[s])]
    cur = np.array([candidate.losses[s] for s in compared], dtype=np.float64)
    ref = np.array([reference.losses[s] for s in compared], dtype=np.float64)
    report = ConvergenceReport(
        passed=False, candidate=candidate.source, reference=reference.source, steps=steps,
        skipped_steps=skipped, compared_steps=compared, checks=checks, problems=problems,
        thresholds=thresholds, common_steps=len(common), notes=step_report.notes,
        intervals={"candidate": step_report.candidate.interval, "reference": step_report.reference.interval},
    )

    checks.append(_correlation_check(report, cur, ref, thresholds))
    checks.append(_pointwise_check(report, compared, cur, ref, thresholds))
    checks.append(_final_loss_check(report, candidate, reference, common, thresholds))
    checks.append(_outliers_check(report, compared, cur, ref, thresholds))
    report.passed = all(check.passed for check in checks)
    return report


def _correlation_check(report: ConvergenceReport, cur: np.ndarray, ref: np.ndarray, thresholds: Thresholds) -> Check:
    # undefined for fewer than two points or a flat curve, which fails rather than passing by NaN comparison
    if len(cur) < 2 or float(np.std(cur)) == 0.0 or float(np.std(ref)) == 0.0:
        return Check(name="correlation", passed=False, value=None, limit=f">= {thresholds.correlation}",
                     detail=f"undefined over {len(cur)} compared point(s) (needs 2+ and a non-flat curve)")
    corr = float(np.corrcoef(cur, ref)[0, 1])
    report.correlation = corr
    return Check(name="correlation", passed=corr >= thresholds.correlation, value=corr,
                 limit=f">= {thresholds.correlation}")


def _pointwise_check(report: ConvergenceReport, compared: list[int], cur: np.ndarray, ref: np.ndarray,
                     thresholds: Thresholds) -> Check:
    ratio_limit = f"share <= {thresholds.max_outlier_ratio}"
    if not compared:
        return Check(name="pointwise", passed=False, value=None, limit=ratio_limit, detail="no compared points")
    failing = []
    for step, c, r in zip(compared, cur, ref):
        diff, tol = relative_difference(float(c), float(r)), thresholds.pointwise_tolerance(float(r))
        if diff > tol:
            failing.append(f"step {step}: {diff:.4g} > {tol}")
    report.pointwise_failures = len(failing)
    share = len(failing) / len(compared)
    shown = "; ".join(failing[:SHOWN_FAILURES]) + (" ..." if len(failing) > SHOWN_FAILURES else "")
    return Check(name="pointwise", passed=share <= thresholds.max_outlier_ratio, value=share,
                 limit=ratio_limit, detail=f"{len(failing)}/{len(compared)} over tolerance"
                 + (f": {shown}" if failing else ""))


def _final_loss_check(report: ConvergenceReport, candidate: LossCurve, reference: LossCurve, common: list[int],
                      thresholds: Thresholds) -> Check:
    final_limit = f"<= {thresholds.final_loss_tolerance}"
    if not common:
        return Check(name="final_loss", passed=False, value=None, limit=final_limit,
                     detail="the curves have no step in common")
    final = common[-1]  # the last step both have: the reference's last, unless the candidate stopped early
    c_last, r_last = candidate.losses[final], reference.losses[final]
    if not (is_finite(c_last) and is_finite(r_last)):
        return Check(name="final_loss", passed=False, value=None, limit=final_limit,
                     detail=f"step {final} has no finite loss on both sides")
    diff = relative_difference(c_last, r_last)
    report.final_loss_difference = diff
    return Check(name="final_loss", passed=diff <= thresholds.final_loss_tolerance, value=diff,
                 limit=final_limit, detail=f"step {final}: {c_last:.6g} vs {r_last:.6g}")


def _outliers_check(report: ConvergenceReport, compared: list[int], cur: np.ndarray, ref: np.ndarray,
                    thresholds: Thresholds) -> Check:
    ratio_limit = f"share <= {thresholds.max_outlier_ratio}"
    if not compared:
        return Check(name="outliers", passed=False, value=None, limit=ratio_limit, detail="no compared points")
    delta = cur - ref
    spread = float(np.std(delta))  # population std (ddof=0), as numpy's default
    far = np.abs(delta - float(np.mean(delta))) > thresholds.outlier_sigma * spread
    outlier_steps = [s for s, flag in zip(compared, far) if flag]
    report.outliers = len(outlier_steps)
    share = len(outlier_steps) / len(compared)
    return Check(name="outliers", passed=share <= thresholds.max_outlier_ratio, value=share, limit=ratio_limit,
                 detail=f"{len(outlier_steps)}/{len(compared)} beyond {thresholds.outlier_sigma:g} sigma"
                 + (f": steps {_fmt_steps(outlier_steps[:SHOWN_FAILURES])}" if outlier_steps else ""))


def format_report(report: ConvergenceReport) -> str:
    """A readable table: one line per check, then each NaN / missing step by name."""
    lines = [
        f"convergence: {'PASS' if report.passed else 'FAIL'}",
        f"candidate: {report.candidate}",
        f"reference: {report.reference}",
        f"steps: {len(report.steps)} ({report.steps[0]}-{report.steps[-1]}), logged every "
        f"{report.intervals.get('candidate') or '-'} (candidate) and {report.intervals.get('reference') or '-'} "
        f"(reference); {report.common_steps} common; first {len(report.skipped_steps)} of those skipped for "
        f"correlation/pointwise/outliers; {len(report.compared_steps)} compared",
        *[f"note: {note}" for note in report.notes],
        "",
    ]
    rows = [("check", "result", "value", "limit", "detail")]
    for check in report.checks:
        value = "-" if check.value is None else f"{check.value:.6g}"
        rows.append((check.name, "pass" if check.passed else "FAIL", value, check.limit, check.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4])
    if report.problems:
        lines += ["", "problems:"] + [f"  {problem}" for problem in report.problems]
    return "\n".join(line.rstrip() for line in lines)
