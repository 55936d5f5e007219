"""A tuned card against its own numbers (cards/tuning_checks.py): each contradiction of the ``tuning`` block with
itself, with ``result`` or with ``status: verified`` is an error naming the field, starting from the catalog's tuned
card with a consistent remeasured gain added."""

from __future__ import annotations

import copy
import statistics

import pytest

from openrecipes.cards.validate import validate_paths

from .card_fixtures import CATALOG, read_card_data

TUNED_CARD = CATALOG / "qwen3-30b-a3b" / "h200" / "qwen3-30b-a3b-16l-tune-start-tuned.yaml"


def _with_gain(card: dict, start: list[float], winner: list[float]) -> dict:
    """``card`` with a remeasured gain of these samples and the figures that follow from them."""
    pairs = [w / s - 1 for s, w in zip(start, winner)]
    card["tuning"]["gain"] = {"start_tokens_per_s_per_gpu": start, "winner_tokens_per_s_per_gpu": winner,
                              "pair_gains": pairs, "median_gain": statistics.median(pairs),
                              "start_spread": (max(start) - min(start)) / statistics.median(start)}
    card["tuning"]["start_tokens_per_s_per_gpu"] = statistics.median(start)
    card["tuning"]["tuned_tokens_per_s_per_gpu"] = statistics.median(winner)
    card["result"]["runs"] = len(winner)  # the card's result: the median of the winner's samples
    return card


@pytest.fixture
def tuned() -> dict:
    card = copy.deepcopy(read_card_data(TUNED_CARD))
    trials = card["tuning"]["trials"]
    start = trials[0]["measured_tokens_per_s_per_gpu"]
    winner = next(t for t in trials if t["role"] == "winner")["measured_tokens_per_s_per_gpu"]
    return _with_gain(card, [start, start * 0.99, start * 1.01], [winner, winner * 0.995, winner * 1.005])


def _errors(card: dict, write_card) -> dict[str, str]:
    _, problems = validate_paths([write_card(card)])
    return {p.path: p.message for p in problems if p.severity == "error"}


def _trial(card: dict, role: str) -> dict:
    return next(t for t in card["tuning"]["trials"] if t["role"] == role)


def test_a_consistent_tuned_card_validates(tuned, write_card):
    assert _errors(tuned, write_card) == {}


def _first(card: dict, role: str) -> float:
    return _trial(card, role)["measured_tokens_per_s_per_gpu"]


def _remeasured(card: dict, start: list[float], winner: list[float]) -> dict:
    """Two more pairs of these samples after the two trials (the first sample of each)."""
    return _with_gain(card, [_first(card, "start"), *start], [_first(card, "winner"), *winner])


def _spread_zero(card: dict) -> dict:
    start = _first(card, "start")
    card = _remeasured(card, [start * 1.25, start * 0.75], [_first(card, "winner")] * 2)
    card["tuning"]["gain"]["start_spread"] = 0.0
    return card


def _changed(path: tuple, value) -> callable:
    def change(card: dict) -> dict:
        node = card
        for key in path[:-1]:
            node = node[key] if not callable(key) else key(node)
        node[path[-1]] = value
        return card
    return change


def _winner(trials: list) -> dict:
    return next(t for t in trials if t["role"] == "winner")


def _ablated(card: dict) -> dict:
    ablated = card["tuning"]["tuned_tokens_per_s_per_gpu"] / 1.03  # contributes +3 %
    card["tuning"]["ablations"] = [{"knob": "offload", "measured_tokens_per_s_per_gpu": ablated, "contribution": 7.5}]
    return card


# what is changed -> (the change, the field the error names, a word of its message)
CASES = {
    "gain inside the start's noise": (lambda c: _remeasured(c, [10_000.0, 14_000.0], [10_100.0, 14_100.0]),
                                      "tuning.gain.median_gain", "spread"),
    "negative remeasured gain": (lambda c: _remeasured(c, [30_000.0, 30_000.0], [27_000.0, 27_000.0]),
                                 "tuning.gain.pair_gains", "every remeasured pair"),
    "pairs of mixed sign": (lambda c: _remeasured(c, [20_000.0, 20_000.0], [18_000.0, 21_000.0]),
                            "tuning.gain.pair_gains", "every remeasured pair"),
    "a start spread of 0 under samples that span 50 %": (_spread_zero, "tuning.gain.start_spread", "span"),
    "a tuned figure against its samples and the card's run": (
        _changed(("tuning", "tuned_tokens_per_s_per_gpu"), 99_999.0), "tuning.tuned_tokens_per_s_per_gpu", "median"),
    "a start figure against its samples": (
        _changed(("tuning", "start_tokens_per_s_per_gpu"), 1_000.0), "tuning.start_tokens_per_s_per_gpu", "median"),
    "the winner's trial against its first sample": (
        _changed(("tuning", "trials", _winner, "measured_tokens_per_s_per_gpu"), 20_000.0),
        "tuning.gain.winner_tokens_per_s_per_gpu[0]", "first sample"),
    "the card's result against the tuned figure": (
        _changed(("result", "tokens_per_s_per_gpu"), 20_000.0), "result.tokens_per_s_per_gpu", "one figure"),
    "the card's runs against the winner's samples": (
        _changed(("result", "runs"), 1), "result.runs", "median of 3 run(s)"),
    "two winners": (_changed(("tuning", "trials", 1, "role"), "winner"), "tuning.trials", "role winner"),
    "no start": (_changed(("tuning", "trials", 0, "role"), "trial"), "tuning.trials", "role start"),
    "trials numbered twice": (_changed(("tuning", "trials", 2, "trial"), 1), "tuning.trials", "each once"),
    "an ablation's contribution against its measurement": (_ablated, "tuning.ablations[0].contribution", "measured"),
    "a billion minutes": (_changed(("tuning", "minutes"), 1e9), "tuning.minutes", "year"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_contradiction_is_an_error_naming_its_field(tuned, write_card, case):
    change, field, word = CASES[case]
    errors = _errors(change(tuned), write_card)
    assert field in errors and word in errors[field], errors


def test_a_verified_card_slower_than_its_start_is_an_error(tuned, write_card):
    del tuned["tuning"]["gain"]  # the trials alone: the winner's trial is the tuned figure, over one run
    tuned["result"]["runs"] = 1
    tuned["tuning"]["start_tokens_per_s_per_gpu"] = _first(tuned, "start")
    tuned["tuning"]["tuned_tokens_per_s_per_gpu"] = _first(tuned, "winner")
    assert _errors(tuned, write_card) == {}
    tuned["tuning"]["trials"][0]["measured_tokens_per_s_per_gpu"] = 30_000.0
    tuned["tuning"]["start_tokens_per_s_per_gpu"] = 30_000.0
    errors = _errors(tuned, write_card)
    assert "faster than its start" in errors["tuning.tuned_tokens_per_s_per_gpu"], errors
    tuned["status"] = "unverified"  # not claimed: the contradiction with the status is gone
    assert "tuning.tuned_tokens_per_s_per_gpu" not in _errors(tuned, write_card)


def test_a_reversed_window_is_an_error_not_a_traceback(tuned, write_card):
    tuned["result"]["window"] = [11, 5]
    errors = _errors(tuned, write_card)
    assert "start <= end" in errors["result.window"], errors


def _with_reference(card: dict) -> dict:
    """``card`` tuned from a reference: its start predicted at 153.3 GiB of 140, the reference offloading 0.4."""
    _trial(card, "start")["changes"] = "offload.fraction=0.4"
    card["tuning"]["reference"] = {"start": "start.yaml", "start_predicted_peak_gib": 153.3, "start_failure": None,
                                   "capacity_gib": 140.0, "margin": 0.05, "changes": "offload.fraction=0.4",
                                   "predicted_peak_gib": 131.2}
    return card


def _ran_out_first(card: dict) -> dict:
    """The start's trial listed first, out of memory, before the reference."""
    card = _with_reference(card)
    trials = card["tuning"]["trials"]
    numbers = [t["trial"] for t in trials]
    for trial in trials:
        trial["trial"] += 1
    trials.insert(0, {"trial": min(numbers), "role": "trial", "changes": "the starting point",
                      "failure": "out_of_memory", "wall_s": 30.0})
    card["tuning"]["reference"].update(start_failure="out_of_memory", start_predicted_peak_gib=120.0)
    return card


def test_a_card_tuned_from_a_reference_validates(tuned, write_card):
    assert _errors(_with_reference(copy.deepcopy(tuned)), write_card) == {}
    assert _errors(_ran_out_first(tuned), write_card) == {}  # a start predicted to fit, that ran out


REFERENCE_CASES = {
    "a start predicted to fit": (lambda c: _changed(("tuning", "reference", "start_predicted_peak_gib"), 120.0)(
        _with_reference(c)), "tuning.reference.start_predicted_peak_gib", "predicted to fit is measured itself"),
    "a reference predicted not to fit": (lambda c: _changed(("tuning", "reference", "predicted_peak_gib"), 135.0)(
        _with_reference(c)), "tuning.reference.predicted_peak_gib", "predicted to fit"),
    "a reference other than the start's trial": (lambda c: _changed(("tuning", "reference", "changes"),
                                                                     "offload.fraction=1.0")(_with_reference(c)),
                                                 "tuning.reference.changes", "the trial of role start"),
    "an out-of-memory start that is not the first trial": (lambda c: _changed(
        ("tuning", "reference", "start_failure"), "out_of_memory")(_with_reference(c)),
        "tuning.reference.start_failure", "is the reference"),
    "a trial before the reference that did not run out": (lambda c: _changed(
        ("tuning", "trials", 0, "failure"), "crash")(_ran_out_first(c)), "tuning.trials[1].trial", "measured first"),
}


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_each_contradiction_of_a_reference_is_an_error_naming_its_field(tuned, write_card, case):
    change, field, word = REFERENCE_CASES[case]
    errors = _errors(change(tuned), write_card)
    assert field in errors and word in errors[field], errors


def test_without_a_reference_the_start_is_the_first_trial(tuned, write_card):
    card = _ran_out_first(tuned)
    del card["tuning"]["reference"]
    errors = _errors(card, write_card)
    assert "measured first" in errors.get("tuning.trials[1].trial", ""), errors
