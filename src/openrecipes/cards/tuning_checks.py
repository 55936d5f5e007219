"""A tuned card against itself: the ``tuning`` block (docs/tune.md) related to the card's ``result`` and ``status``.

The tuner writes one record of its numbers (``tune/remeasure.py`` ``Gain``): the start's and the winner's samples, the
first of each its search trial, then each interleaved remeasurement. From it follow ``start_tokens_per_s_per_gpu`` and
``tuned_tokens_per_s_per_gpu`` (the medians of the samples; without remeasured pairs, the two trials), the gain (the
median of the pair gains), the start's own spread and each ablation's contribution (the winner's median over the
ablated run, less one); the card's result is the tuned figure, over as many runs as the winner has samples (its
trial's run is the card's run: its curves, window and step-time spread).
A verified tuned card is one whose gain is real: a winner faster than the start, every remeasured pair of one sign and
the median gain outside the start's own spread. A starting point that did not fit (``tuning.reference``) was replaced
by its reference, the trial of role start: it names that trial's changes, fits where the start did not, and only the
starting point and references that ran out of memory come before it.
"""

from __future__ import annotations

import statistics

from openrecipes.cards.findings import Finding, Loc, half_unit
from openrecipes.cards.schema import RecipeCard, Tuning, TuningReference

# figures the tuner writes at full precision; a card edited by hand may round them to their written digits, but a
# fraction (a spread, a contribution) no more loosely than to the percent
RELATIVE_SLACK = 1e-6
FRACTION_ROUNDING = 0.005
# a tuning run is a command someone waited for: a year of wall time is a typing error
MAX_MINUTES = 366 * 24 * 60


def _differs(stated: float, computed: float, *, fraction: bool = False) -> bool:
    rounding = min(half_unit(stated), FRACTION_ROUNDING) if fraction else half_unit(stated)
    return abs(stated - computed) > max(rounding, RELATIVE_SLACK * abs(computed)) + 1e-12


def check_tuning(card: RecipeCard) -> list[Finding]:
    tuning = card.tuning
    if tuning is None:
        return []
    out = _trial_roles(tuning) + _screened_trials(tuning)
    if tuning.reference is not None:
        out += _reference(tuning, tuning.reference)
    start = next((t for t in tuning.trials if t.role == "start"), None)
    winners = [t for t in tuning.trials if t.role == "winner"]
    winner = winners[0] if len(winners) == 1 else start if not winners else None
    if start is None or winner is None or start.measured_tokens_per_s_per_gpu is None:
        return out
    if winner.measured_tokens_per_s_per_gpu is None:
        return out + [Finding(loc=("tuning", "trials", tuning.trials.index(winner), "failure"),
                              message="the card's recipe is a trial without a measurement")]
    out += _result_is_the_tuned_figure(card, tuning)
    out += _headline_figures(tuning, start.measured_tokens_per_s_per_gpu, winner.measured_tokens_per_s_per_gpu)
    out += _ablations(tuning)
    # the command's wall time: a rerun that reuses recorded trials takes less than they once did, so no lower bound
    if not 0 <= tuning.minutes <= MAX_MINUTES:
        out.append(Finding(loc=("tuning", "minutes"), message=f"{tuning.minutes} minutes is more than a year"))
    if card.status == "verified":
        out += _verified_gain(tuning, winner is start)
    return out


def _result_is_the_tuned_figure(card: RecipeCard, tuning: Tuning) -> list[Finding]:
    """The card quotes one throughput: its result is the tuned figure (the median of the winner's samples, or its
    trial's measurement without a remeasured gain), over as many runs as there are samples."""
    out = []
    if _differs(card.result.tokens_per_s_per_gpu, tuning.tuned_tokens_per_s_per_gpu):
        out.append(Finding(loc=("result", "tokens_per_s_per_gpu"), message=(
            f"{card.result.tokens_per_s_per_gpu} but tuning.tuned_tokens_per_s_per_gpu is "
            f"{tuning.tuned_tokens_per_s_per_gpu}: a tuned card quotes one figure for its recipe")))
    samples = len(tuning.gain.winner_tokens_per_s_per_gpu) if tuning.gain is not None else 1
    if card.result.runs != samples:
        out.append(Finding(loc=("result", "runs"), message=(
            f"{card.result.runs} but the tuned figure is the median of {samples} run(s) of the winner")))
    return out


def _screened_trials(tuning: Tuning) -> list[Finding]:
    """A screened candidate names the trial it later ran as: one of the card's trials (its figures are there, the
    fleet's; the screen's are one rank's)."""
    if tuning.screen is None:
        return []
    numbers = {t.trial for t in tuning.trials}
    return [Finding(loc=("tuning", "screen", "candidates", i, "trial"),
                    message=f"trial {c.trial} is not one of tuning.trials")
            for i, c in enumerate(tuning.screen.candidates) if c.trial is not None and c.trial not in numbers]


def _trial_roles(tuning: Tuning) -> list[Finding]:
    out = []
    numbers = [t.trial for t in tuning.trials]  # in the order they ended (several at once on Slurm)
    if len(numbers) != len(set(numbers)):
        out.append(Finding(loc=("tuning", "trials"), message=f"trials numbered {numbers}: each once"))
    for role, most in (("start", 1), ("winner", 1)):
        count = sum(t.role == role for t in tuning.trials)
        if count > most or (role == "start" and count == 0):
            out.append(Finding(loc=("tuning", "trials"), message=f"{count} trials of role {role}; a card has one"))
    start = next((t for t in tuning.trials if t.role == "start"), None)
    if start is not None and start.trial != numbers[0]:
        before = tuning.trials[:tuning.trials.index(start)]
        if tuning.reference is None or any(t.failure != "out_of_memory" for t in before):
            after = "" if tuning.reference is None else ", after the starting point if it ran out of memory"
            out.append(Finding(loc=("tuning", "trials", tuning.trials.index(start), "trial"),
                               message=f"the start is trial {start.trial}, but it is measured first{after}"))
    return out


def _reference(tuning: Tuning, reference: TuningReference) -> list[Finding]:
    """A reference in place of a start that did not fit: the trial of role start, predicted to fit where the start
    was not (or its trial, the first, ran out of memory)."""
    loc: Loc = ("tuning", "reference")
    out = []
    start = next((t for t in tuning.trials if t.role == "start"), None)
    if start is not None and start.changes != reference.changes:
        out.append(Finding(loc=(*loc, "changes"), message=(
            f"{reference.changes!r} but the trial of role start, the reference, changed {start.changes!r}")))
    limit = reference.capacity_gib * (1 - reference.margin)
    text = f"of {reference.capacity_gib} GiB with {reference.margin:.3g} left free (at most {limit:.6g} GiB)"
    if reference.predicted_peak_gib > limit * (1 + RELATIVE_SLACK):
        out.append(Finding(loc=(*loc, "predicted_peak_gib"), message=(
            f"{reference.predicted_peak_gib} GiB {text}: the reference is a change predicted to fit")))
    if reference.start_failure is None and reference.start_predicted_peak_gib <= limit * (1 - RELATIVE_SLACK):
        out.append(Finding(loc=(*loc, "start_predicted_peak_gib"), message=(
            f"{reference.start_predicted_peak_gib} GiB {text}: a start predicted to fit is measured itself, unless "
            "its trial ran out of memory (start_failure)")))
    first = tuning.trials[0]
    if reference.start_failure is not None and (first is start or first.failure != reference.start_failure):
        ended = "is the reference" if first is start else f"ended with {first.failure or 'a measurement'}"
        out.append(Finding(loc=(*loc, "start_failure"), message=(
            f"{reference.start_failure} but the first trial, the starting point's, {ended}")))
    return out


def _headline_figures(tuning: Tuning, start_trial: float, winner_trial: float) -> list[Finding]:
    """start and tuned tokens/s: the medians of the remeasured samples, whose first is each one's trial."""
    gain, out = tuning.gain, []
    start_samples, winner_samples = ([start_trial], [winner_trial]) if gain is None else (
        gain.start_tokens_per_s_per_gpu, gain.winner_tokens_per_s_per_gpu)
    if gain is not None:
        for loc, first, trial in ((("tuning", "gain", "start_tokens_per_s_per_gpu", 0), start_samples[0], start_trial),
                                  (("tuning", "gain", "winner_tokens_per_s_per_gpu", 0), winner_samples[0],
                                   winner_trial)):
            if _differs(first, trial):
                out.append(Finding(loc=loc, message=f"{first} but the first sample is the trial's, {trial}"))
        spread = (max(start_samples) - min(start_samples)) / statistics.median(start_samples)
        if _differs(gain.start_spread, spread, fraction=True):
            out.append(Finding(loc=("tuning", "gain", "start_spread"), message=(
                f"{gain.start_spread} but the start's samples span (max - min) / median = {spread:.6g}")))
    for field, samples in (("start_tokens_per_s_per_gpu", start_samples),
                           ("tuned_tokens_per_s_per_gpu", winner_samples)):
        stated, median = getattr(tuning, field), statistics.median(samples)
        if _differs(stated, median):
            what = "the median of its samples in tuning.gain" if gain is not None else "its trial's measurement"
            out.append(Finding(loc=("tuning", field), message=f"{stated} but {what} is {median:.6g}"))
    return out


def _ablations(tuning: Tuning) -> list[Finding]:
    winner = tuning.tuned_tokens_per_s_per_gpu
    out = []
    for index, ablation in enumerate(tuning.ablations):
        measured, stated = ablation.measured_tokens_per_s_per_gpu, ablation.contribution
        if (measured is None) != (stated is None):
            out.append(Finding(loc=("tuning", "ablations", index), message=(
                "a contribution needs the ablated run's measurement, and a measurement its contribution")))
        elif measured is not None and _differs(stated, winner / measured - 1, fraction=True):
            out.append(Finding(loc=("tuning", "ablations", index, "contribution"), message=(
                f"{stated} but tuned_tokens_per_s_per_gpu {winner} / measured {measured} - 1 = "
                f"{winner / measured - 1:.6g}")))
    return out


def _verified_gain(tuning: Tuning, card_is_start: bool) -> list[Finding]:
    """What makes a tuned card's gain real enough to verify."""
    loc: Loc = ("tuning", "gain")
    if card_is_start:
        return []  # no faster recipe: the card is the start itself, no gain is claimed
    out = []
    if tuning.tuned_tokens_per_s_per_gpu <= tuning.start_tokens_per_s_per_gpu:
        out.append(Finding(loc=("tuning", "tuned_tokens_per_s_per_gpu"), message=(
            f"{tuning.tuned_tokens_per_s_per_gpu} is not above start_tokens_per_s_per_gpu "
            f"{tuning.start_tokens_per_s_per_gpu}: a verified tuned card is faster than its start")))
    gain = tuning.gain
    if gain is None:
        return out
    if min(gain.pair_gains) <= 0:
        out.append(Finding(loc=(*loc, "pair_gains"), message=(
            f"pairs from {min(gain.pair_gains):+.1%} to {max(gain.pair_gains):+.1%}: a verified tuned card needs "
            "every remeasured pair faster")))
    if gain.median_gain <= gain.start_spread:
        out.append(Finding(loc=(*loc, "median_gain"), message=(
            f"{gain.median_gain:+.1%} is within the start's own spread {gain.start_spread:.1%}: a verified tuned card "
            "needs a gain above it")))
    return out
