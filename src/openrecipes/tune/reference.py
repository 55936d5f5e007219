"""A start that does not fit the device: the tuner says so before spending a trial on it and tunes from the smallest
change of it that fits.

A user's first recipe often does not fit. When the planner predicts the start's peak above what the memory margin
leaves free (``Calibration.leaves_margin``, the rule every ranked candidate obeys), or the start's trial runs out of
memory, the search looks for a *reference*: the start with the fewest knobs changed, among the knobs that trade speed
for memory (``space.MEMORY_KNOBS``: the layout, rows per microbatch, recompute, optimizer and activation offload, the
chunked loss and the allocator), that is predicted to fit with the margin; among as few changes, the fastest
predicted (the offload fraction and the recomputed layers are solved as the least of each that fits,
``tune/solve.py``). It looks one knob away from the start first, then two, then over the planner's first ranking.

The reference is measured where the start would have been (phase ``start``, every step) and the search tunes from it:
the gain, the convergence check and the remeasured pairs are against it. Candidates' changes and the numerics rules
stay against the user's start, whose numerics the reference keeps (it changes performance-only fields only). A
reference that runs out of memory too bounds the memory model as any trial does, and the next is chosen below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from openrecipes.config.recipe import Recipe
from openrecipes.tune.journal import Journal
from openrecipes.tune.options import TuneOptions
from openrecipes.tune.predict import Calibration, Prediction
from openrecipes.tune.progress import Progress
from openrecipes.tune.space import (MEMORY_KNOBS, Candidate, ModelFacts, Settings, changed_knobs, describe_changes,
                                    first_ranking_space, neighbours, start_settings)


def gib(value: float) -> str:
    """GiB as the console and the card's notes print them: four significant digits (153.3, 0.6061)."""
    return f"{value:.4g}"


@dataclass(frozen=True, kw_only=True)
class UnfitStart:
    """The user's start that did not fit, and the reference the search measured and tuned from instead."""

    peak_gib: float  # the start's peak as the search expected it before any trial: what must fit the device
    capacity_gib: float  # one device's memory the tuner planned against
    margin: float  # the share of it the reference leaves free
    failure: str | None  # "out_of_memory" when the start's trial ran out; None: predicted not to fit, never run
    reference: Candidate
    reference_peak_gib: float  # as the search expected it when it chose the reference

    def _why(self) -> str:
        if self.failure:
            return (f"the start ran out of memory though predicted at {gib(self.peak_gib)} GiB of "
                    f"{gib(self.capacity_gib)} GiB")
        return (f"the start is predicted at {gib(self.peak_gib)} GiB of {gib(self.capacity_gib)} GiB "
                f"({100 * self.margin:.3g} % left free: at most {gib(self.capacity_gib * (1 - self.margin))} GiB): "
                "it does not fit")

    def describe(self) -> str:
        """The console's line, said before the reference's trial."""
        return (f"{self._why()}; tuning from {describe_changes(self.reference.changes)} instead (predicted "
                f"{gib(self.reference_peak_gib)} GiB), the smallest change of its memory knobs that fits")

    def note(self, start: str) -> str:
        """The card's note: both recipes, and what the card's gains are against."""
        return (f"The starting point {start} did not fit: {self._why()[len('the start '):]}. The tuner measured the "
                f"smallest change of its memory knobs predicted to fit instead, "
                f"{describe_changes(self.reference.changes)} (predicted {gib(self.reference_peak_gib)} GiB), as the "
                "reference: the start's figures, the gain and the convergence check here are that reference's; its "
                "numerics are the starting point's (numerics rules).")

    def card_block(self, start: str) -> dict[str, Any]:
        """The card's ``tuning.reference`` (cards.schema.TuningReference)."""
        return {"start": start, "start_predicted_peak_gib": self.peak_gib, "start_failure": self.failure,
                "capacity_gib": self.capacity_gib, "margin": self.margin,
                "changes": describe_changes(self.reference.changes), "predicted_peak_gib": self.reference_peak_gib}


class ReferenceFallback:
    """How a ``Search`` measures its start, a mixin reading the search's state (the attributes below): the start
    itself when it fits, else the reference (``reference``, ``unfit``). It calls the search's ``run_trial``,
    ``_ranked``, ``_solved``, ``_failed_like`` and the budget's ``_timeout``."""

    options: TuneOptions
    out: Path
    start: Recipe
    facts: ModelFacts
    calibration: Calibration
    progress: Progress
    journal: Journal
    tried: dict[str, Candidate]
    trial_index: int
    reference: Candidate  # what the search measured as its start: the start itself unless it did not fit
    unfit: UnfitStart | None

    def measure_start(self, start: Candidate, prediction: Prediction) -> None:
        """Measure the start or, when it does not fit (predicted so, or its trial ran out of memory), the reference;
        ValueError when neither can be measured."""
        expected = self.calibration.peak_gib(prediction)
        failure = None
        if self.calibration.leaves_margin(prediction):
            cut_by_budget = self._timeout("start") < self.options.trial_timeout_s
            record = self.run_trial(start, prediction, "start")
            if record["status"] == "ok":
                return
            if record["failure"]["class"] != "out_of_memory":
                raise self._failed(record, cut_by_budget, "the starting point")
            failure = record["failure"]["class"]  # its peak now bounds the memory model (the refit after it)
        while True:
            found = self._fitting_reference()
            if found is None:
                raise ValueError(self._nothing_fits(expected, prediction, failure))
            self.unfit = UnfitStart(peak_gib=expected, capacity_gib=prediction.capacity_gib,
                                    margin=self.calibration.memory_margin, failure=failure,
                                    reference=found.candidate,
                                    reference_peak_gib=self.calibration.peak_gib(found.prediction))
            self.progress.say(self.unfit.describe())
            self.reference = found.candidate
            cut_by_budget = self._timeout("start") < self.options.trial_timeout_s
            record = self.run_trial(found.candidate, found.prediction, "start")
            if record["status"] == "ok":
                return
            if record["failure"]["class"] != "out_of_memory" or self.trial_index >= self.options.trials:
                raise self._failed(record, cut_by_budget, "the reference")
            # out of memory too: the refit bounds the memory model below it, and the next reference is chosen there
            self.progress.say(f"the reference ran out of memory too (trial {record['index']}): choosing the next "
                              "below it")

    def _failed(self, record: dict[str, Any], cut_by_budget: bool, what: str) -> ValueError:
        failure, log = record["failure"], (self.out / record["run_dir"]).parent / "train.log"
        if failure["class"] == "timeout" and cut_by_budget:
            return ValueError(f"{what} did not finish within --minutes {self.options.minutes:g} "
                              f"({failure['detail']}): the budget must hold the start, the trials and "
                              f"verification; give more minutes (see {log})")
        return ValueError(f"{what} failed ({failure['class']}: {failure['detail']}); see {log}")

    def _nothing_fits(self, expected: float, prediction: Prediction, failure: str | None) -> str:
        knobs = ", ".join(MEMORY_KNOBS)
        why = ("the starting point ran out of memory" if failure else
               f"the start is predicted at {gib(expected)} GiB of {gib(prediction.capacity_gib)} GiB "
               f"({100 * self.calibration.memory_margin:.3g} % left free)")
        return (f"{why}, and no change of its memory knobs ({knobs}) is predicted to fit; give it more devices "
                "(--gpus, with a layout of that world size), more memory (--gpu-memory-gib) or a smaller workload")

    def _fitting_reference(self) -> Any:
        """The untried candidate, fewest knobs from the start and then fastest predicted, that fits with the
        margin (a ``search.Ranked``), or None."""
        base = start_settings(self.start, self.facts)
        for ring in self._reference_rings(base):
            fitting = [r for r in self._ranked(ring) if self._may_be_reference(r.candidate, r.prediction, base)]
            if fitting:
                return min(fitting, key=lambda r: (len(changed_knobs(r.candidate.settings, base)),
                                                   -self.calibration.tokens_per_s_per_gpu(r.prediction),
                                                   r.candidate.key))
        return None

    def _may_be_reference(self, candidate: Candidate, prediction: Prediction, base: Settings) -> bool:
        return (bool(candidate.changes) and candidate.key not in self.tried
                and set(changed_knobs(candidate.settings, base)) <= set(MEMORY_KNOBS)
                and self.calibration.leaves_margin(prediction) and self._failed_like(candidate) is None)

    def _reference_rings(self, base: Settings) -> Iterator[list[Settings]]:
        """Settings ever further from the start: one memory knob away (the solved offload fraction and recomputed
        layers among them), then two, then the planner's first ranking."""
        one = [s for knob, s in neighbours(base, self.start, self.facts) if knob in MEMORY_KNOBS]
        one += self._solved([base])
        yield one
        yield [s for around in dict.fromkeys(one)
               for s in [m for knob, m in neighbours(around, self.start, self.facts) if knob in MEMORY_KNOBS]
               + self._solved([around])]
        space = list(first_ranking_space(self.start, self.facts))
        yield space + self._solved(space)
