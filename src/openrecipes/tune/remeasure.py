"""Honest gains: the start and the winner measured again, interleaved, and each changed knob dropped in turn.

One trial per recipe is one noisy sample (two CPU processes vary by tens of percent from run to run), so before a
card is written the start and the winner run again in turns (start, winner, start, winner, ...: same rows, steps,
processes and window). Each pair gives a gain ``winner / start - 1``; with the two trials of the search as the first
pair, the gain is the median of the pairs and its spread their range. The winner is faster only when every pair says
so and the median gain exceeds the start's own spread (its samples' range over their median); otherwise the tuner
reports that no faster recipe was found.

Ablations, as the budget allows: the winner with one of its changed knobs set back to the start's value, measured
once each; a knob's contribution is the winner's median over that run, minus one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from openrecipes.tune.progress import failure_text
from openrecipes.tune.search import Search
from openrecipes.tune.space import KNOBS, Candidate, describe_changes

REMEASURE_KEY = "remeasure{n}-{key}"


@dataclass(frozen=True, kw_only=True)
class Gain:
    start: tuple[float, ...]  # tokens/s/GPU, the search's trial first, then each remeasurement
    winner: tuple[float, ...]
    pairs: tuple[float, ...]  # winner / start - 1 of each interleaved pair
    failure: str | None = None  # the winner failed when run again: it is not a recipe to publish

    @property
    def median(self) -> float:
        return statistics.median(self.pairs)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.pairs), max(self.pairs)

    @property
    def start_noise(self) -> float:
        return (max(self.start) - min(self.start)) / statistics.median(self.start)

    @property
    def faster(self) -> bool:
        return self.failure is None and self.spread[0] > 0 and self.median > self.start_noise

    def describe(self) -> str:
        if self.failure:
            return f"the winner failed when measured again ({self.failure})"
        from openrecipes.cards.schema import TuningGain

        return TuningGain(**self.card_block()).describe()

    def card_block(self) -> dict[str, Any]:
        """The card's ``tuning.gain`` (cards.schema.TuningGain)."""
        return {"start_tokens_per_s_per_gpu": list(self.start), "winner_tokens_per_s_per_gpu": list(self.winner),
                "pair_gains": list(self.pairs), "median_gain": self.median, "start_spread": self.start_noise}


def _tps(record: dict[str, Any]) -> float | None:
    return record["measured"]["tokens_per_s_per_gpu"] if record["status"] == "ok" else None


def remeasure(search: Search, winner: dict[str, Any], pairs: int) -> Gain:
    """Run (or reuse, on a rerun) ``pairs`` more interleaved (start, winner) pairs; the gain over every pair."""
    start = search.reference  # the start as measured: its reference when it did not fit (tune/reference.py)
    start_record, candidate = search.journal.find(start.key), search.tried[winner["key"]]
    start_samples, winner_samples = [_tps(start_record)], [_tps(winner)]
    for n in range(1, pairs + 1):
        for role, subject in (("start", start), ("winner", candidate)):
            record = search.run_trial(subject, None, "remeasure", key=REMEASURE_KEY.format(n=n, key=subject.key))
            if record["status"] != "ok" and role == "winner":
                failure = failure_text(record["failure"])
                return Gain(start=tuple(s for s in start_samples if s), winner=(), pairs=(), failure=failure)
            (start_samples if role == "start" else winner_samples).append(_tps(record))
    measured = [(s, w) for s, w in zip(start_samples, winner_samples) if s is not None]
    return Gain(start=tuple(s for s, _ in measured), winner=tuple(w for _, w in measured),
                pairs=tuple(w / s - 1 for s, w in measured))


@dataclass(frozen=True, kw_only=True)
class Ablation:
    knob: str
    changes: str  # what the ablated run still changes against the start
    measured_tokens_per_s_per_gpu: float | None
    contribution: float | None  # winner median / ablated - 1
    note: str = ""

    def describe(self) -> str:
        if self.contribution is None:
            return f"without {self.knob}: {self.note}"
        return (f"without {self.knob} ({self.changes}): {self.measured_tokens_per_s_per_gpu:,.1f} tokens/s/GPU, "
                f"so {self.knob} contributes {self.contribution:+.1%}")


@dataclass(kw_only=True)
class Ablations:
    found: list[Ablation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # knobs the budget left unmeasured


def ablate(search: Search, winner: Candidate, winner_tps: float) -> Ablations:
    """The winner with each changed knob set back to the measured start's (its reference's when it did not fit:
    the knobs the reference changed to fit are not the tuner's gain), one run each, while the budget allows."""
    base = search.reference.settings
    result = Ablations()
    for knob in KNOBS:
        if getattr(winner.settings, knob) == getattr(base, knob):
            continue
        candidate = search.candidate_or_none(replace(winner.settings, **{knob: getattr(base, knob)}))
        if candidate is None or candidate.key == search.reference.key:
            continue  # the measured start itself, or a recipe train refuses
        prediction = search.prediction_if_fits(candidate)
        if prediction is None:
            result.found.append(Ablation(knob=knob, changes=describe_changes(candidate.changes),
                                         measured_tokens_per_s_per_gpu=None, contribution=None,
                                         note="needed: without it the recipe is predicted not to fit or is refused"))
            continue
        if not search.within_budget(prediction, candidate.settings):
            result.skipped.append(knob)
            continue
        record = search.run_trial(candidate, prediction, "ablation")
        tps = _tps(record)
        result.found.append(Ablation(
            knob=knob, changes=describe_changes(candidate.changes), measured_tokens_per_s_per_gpu=tps,
            contribution=None if tps is None else winner_tps / tps - 1,
            note="" if tps is not None else f"needed: without it the run failed ({record['failure']['class']})"))
    return result
