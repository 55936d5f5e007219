"""The steps of two loss curves: each curve's own logging interval, the steps both have, and what is missing.

Tools log a loss every k steps (Megatron ``log_interval``; Megatron-Bridge thins the golden curves of long runs).
A curve's interval is the most common difference between its consecutive steps (the smaller one on a tie). Each
difference must equal it, except the very last, which may be shorter (a final step logged off the grid, at the
end of the run). A larger difference is a gap: the grid steps inside it are missing from the middle of the curve.
Everything is judged arithmetically over the steps actually logged: a gap of a billion steps costs nothing.

The two curves are compared on the steps both have, as Megatron-Bridge does. The candidate must reach the
reference's end: it stops early when its next step on its own interval would still be within the reference.
Candidate steps beyond the reference's end are left out, and the report says so.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

SHOWN_MISSING = 5  # missing steps named one by one per gap; the rest are summarised as a range


@dataclass(frozen=True, kw_only=True)
class Grid:
    """One curve's logged steps (sorted) and the interval they follow (None for a single step)."""

    steps: list[int]
    interval: int | None

    @property
    def first(self) -> int:
        return self.steps[0]

    @property
    def last(self) -> int:
        return self.steps[-1]

    def misses(self, step: int, present: set[int]) -> bool:
        """Whether ``step`` is on this curve's interval, inside its range, and not logged."""
        return (self.interval is not None and self.first < step < self.last and step not in present
                and (step - self.first) % self.interval == 0)


def logging_grid(steps: list[int]) -> Grid:
    if len(steps) < 2:
        return Grid(steps=steps, interval=None)
    differences = Counter(b - a for a, b in zip(steps, steps[1:]))
    most = max(differences.values())
    return Grid(steps=steps, interval=min(d for d, n in differences.items() if n == most))


@dataclass(kw_only=True)
class StepReport:
    candidate: Grid
    reference: Grid
    common: list[int]                                    # steps both curves have, ascending
    problems: list[str] = field(default_factory=list)    # each a failure, by step
    notes: list[str] = field(default_factory=list)       # information that does not fail the check


def compare_steps(candidate_steps: set[int], reference_steps: set[int]) -> StepReport:
    grids = {"candidate": logging_grid(sorted(candidate_steps)), "reference": logging_grid(sorted(reference_steps))}
    present = {"candidate": candidate_steps, "reference": reference_steps}
    report = StepReport(candidate=grids["candidate"], reference=grids["reference"],
                        common=sorted(candidate_steps & reference_steps))
    for side, other in (("candidate", "reference"), ("reference", "candidate")):
        report.problems += _own_interval_problems(side, grids[side], other, grids[other], present[other])
    cand, ref = grids["candidate"], grids["reference"]
    next_step = cand.last + cand.interval if cand.interval is not None else cand.last + 1
    if next_step <= ref.last:
        report.problems.append(f"step {ref.last}: the candidate stops at step {cand.last}, before the reference's "
                               f"last step (its next step, every {cand.interval or 1}, would be {next_step})")
    if cand.last > ref.last:
        report.notes.append(f"the candidate runs past the reference's last step {ref.last} (to {cand.last}): "
                            f"judged on the {len(report.common)} steps both curves have, up to {ref.last}")
    return report


def _own_interval_problems(side: str, grid: Grid, other: str, other_grid: Grid, other_present: set[int]) -> list[str]:
    """Gaps and off-interval steps in one curve's own sequence, each named (a long gap as a range)."""
    if grid.interval is None:
        return []
    k, problems = grid.interval, []
    pairs = list(zip(grid.steps, grid.steps[1:]))
    for index, (a, b) in enumerate(pairs):
        if b - a == k or (index == len(pairs) - 1 and b - a < k):
            continue
        count = (b - a - 1) // k  # grid steps strictly between a and b
        for j in range(1, min(count, SHOWN_MISSING) + 1):
            step = a + j * k
            if step in other_present:
                problems.append(f"step {step}: missing on the {side} (present on the {other})")
            elif other_grid.misses(step, other_present):
                if side == "candidate":  # named once, from the candidate's side
                    problems.append(f"step {step}: missing on both sides (gap in the step sequence)")
            else:
                problems.append(f"step {step}: missing on the {side} (a gap in its log every {k} steps)")
        if count > SHOWN_MISSING:
            first_unnamed = a + (SHOWN_MISSING + 1) * k
            problems.append(f"steps {first_unnamed}-{a + count * k}: {count - SHOWN_MISSING} more missing on the "
                            f"{side} (every {k} steps)")
        if (b - a) % k:
            problems.append(f"step {b}: off the {side}'s logging interval of {k} steps (previous step {a})")
    return problems
