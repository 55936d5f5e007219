"""What the tuner hands back: the tuned recipe YAML, its recipe card (with the trials) and the site.

The card is written by ``openrecipes.cards.new`` from the winner's trial run against the start's, so its numbers
are ``measure``'s and its checks ``verify``'s; ``status: verified`` only when every check passed. Its notes say
where the search started, where it ended, in how many trials and minutes, what changed, the gain as the median of
the interleaved remeasurement with its spread (``tune/remeasure.py``) and, where the budget allowed, each changed
knob's measured contribution.

Every figure it quotes comes from one record (``headline``): the start's and the tuned tokens/s/GPU are the medians
of the remeasured samples (each one's search trial first), the gain their pairs' median, the minutes the command's
wall time up to the card; the console, the card's notes, its ``tuning`` block and the site all quote those.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrecipes.cards.validate import RECIPE_SUFFIXES
from openrecipes.config.recipe import dump_recipe
from openrecipes.tune.family_calibration import start_prediction, start_text
from openrecipes.tune.predict import gpu_memory_gb, safe_name
from openrecipes.tune.remeasure import Ablations, Gain
from openrecipes.tune.screen import screen_block, screen_note
from openrecipes.tune.search import SearchResult
from openrecipes.tune.space import describe_changes
from openrecipes.tune.verification import Verdict
from openrecipes.utils import atomic_write_text

TUNED_FILE = "tuned.yaml"


@dataclass(kw_only=True)
class Published:
    recipe: Path
    card: Path
    site: Path
    status: str
    figures: Headline
    notes: list[str]

    def result_block(self, gain: Gain, *, trials: int) -> dict[str, Any]:
        """``tune.json``'s ``result``: the card's figures, in the card's rounding and words."""
        return {"outcome": "tuned", "status": self.status, "card": str(self.card), "trials": trials,
                "start_tokens_per_s_per_gpu": self.figures.start_tps,
                "tuned_tokens_per_s_per_gpu": self.figures.tuned_tps, "minutes": round(self.figures.minutes, 3),
                "gain": gain.card_block(), "gain_text": gain.describe()}


@dataclass(frozen=True)
class Headline:
    start_tps: float  # the start's tokens/s/GPU: the median of its samples
    tuned_tps: float  # the winner's: the median of its samples
    minutes: float  # the command's wall time up to the card


def headline(result: SearchResult, winner: dict[str, Any], gain: Gain | None, minutes: float) -> Headline:
    """The figures every place quotes: with remeasured pairs the medians of the samples, else the two trials'."""
    start = next(r for r in result.records if r["key"] == result.reference_key)["measured"]["tokens_per_s_per_gpu"]
    tuned = winner["measured"]["tokens_per_s_per_gpu"]
    if gain is not None and gain.pairs:
        start, tuned = statistics.median(gain.start), statistics.median(gain.winner)
    return Headline(start_tps=start, tuned_tps=tuned, minutes=minutes)


def _winner_samples(gain: Gain | None) -> tuple[float, ...]:
    """The winner's samples (its trial first) when it was measured again: the card's result is their median, the
    figure the headline quotes."""
    return tuple(gain.winner) if gain is not None and gain.pairs else ()


def _tuning_block(result: SearchResult, winner_key: str, gain: Gain | None,
                  ablations: Ablations | None, figures: Headline) -> dict[str, Any]:
    trials = []
    for record in result.records:
        prediction = record.get("prediction") or {}
        measured = record.get("measured") or {}
        trials.append({
            "trial": record["index"],
            "role": ("start" if record["key"] == result.reference_key else "winner" if record["key"] == winner_key
                     else "trial"),
            "changes": record["label"],
            "predicted_tokens_per_s_per_gpu": prediction.get("calibrated_tokens_per_s_per_gpu")
            or prediction.get("tokens_per_s_per_gpu"),
            "measured_tokens_per_s_per_gpu": measured.get("tokens_per_s_per_gpu"),
            "failure": (record.get("failure") or {}).get("class"),
            "wall_s": record.get("wall_s"),
            "overhead_s": record.get("overhead_s"),
        })
    block = {"start_tokens_per_s_per_gpu": figures.start_tps, "tuned_tokens_per_s_per_gpu": figures.tuned_tps,
             "minutes": round(figures.minutes, 3), "pruned": result.pruned, "trials": trials}
    if gain is not None and gain.pairs:
        block["gain"] = gain.card_block()
    if result.screen:  # measured one rank at a time: a block of its own, never mixed with the trials' figures
        block["screen"] = screened(result)
    if result.unfit is not None:  # the start did not fit: the reference is the "start" of the figures above
        block["reference"] = result.unfit.card_block(_shown(result.start_path))
    if ablations is not None:
        block["ablations"] = [{"knob": a.knob, "measured_tokens_per_s_per_gpu": a.measured_tokens_per_s_per_gpu,
                               "contribution": a.contribution, "note": a.note} for a in ablations.found]
    return block


def screened(result: SearchResult) -> dict[str, Any]:
    """The screen's block, each candidate named by the trial it later ran as on the fleet."""
    return screen_block(result.screen, {r["key"]: r["index"] for r in result.records})


def _why(start: dict[str, Any], winner: dict[str, Any]) -> str:
    s, w = start["measured"], winner["measured"]
    text = (f"mean step time {s['step_time_mean_s']:.4g} s -> {w['step_time_mean_s']:.4g} s "
            f"({w['step_time_mean_s'] / s['step_time_mean_s'] - 1:+.1%})")
    if s.get("peak_memory_gib") and w.get("peak_memory_gib"):
        text += f"; peak memory {s['peak_memory_gib']:.1f} GiB -> {w['peak_memory_gib']:.1f} GiB"
    return text


def _shown(path: Path) -> str:
    """A path as a card may print it: relative to the working directory where it lies under it, else its name."""
    try:
        return Path(path).resolve().relative_to(Path.cwd()).as_posix()
    except ValueError:
        return Path(path).name


def notes_for(result: SearchResult, winner: dict[str, Any], status: str, failed: list[Verdict], figures: Headline,
              gain: Gain | None = None, ablations: Ablations | None = None) -> list[str]:
    start = next(r for r in result.records if r["key"] == result.reference_key)
    failures = [r for r in result.records if r["status"] == "failed"]
    measured = ("medians of the start's and the winner's runs" if gain is not None and len(gain.pairs) > 1
                else "one run each")
    started = (f"starting point {_shown(result.start_path)}" if result.unfit is None else
               f"starting point {_shown(result.start_path)} (did not fit) and its reference")
    notes = [f"openrecipes tune: {started}, {figures.start_tps:,.1f} tokens/s/GPU; "
             f"tuned to {figures.tuned_tps:,.1f} ({measured}); {len(result.records)} trials in "
             f"{figures.minutes:.1f} minutes ({len(failures)} failed, {result.pruned} candidates left out "
             "without a trial)."]
    if result.unfit is not None:
        notes.append(result.unfit.note(_shown(result.start_path)))
    if (predicted := start_prediction(result.records)) is not None:  # how far the first prediction was off
        notes.append(f"Before any trial of its own, {start_text(predicted, _shown)}.")
    if result.screen:
        notes.append(screen_note(screened(result)))
    if result.options.gpu_memory_gib is not None:
        notes.append(f"Candidates were fitted into {result.options.gpu_memory_gib:g} GiB per device "
                     "(openrecipes tune --gpu-memory-gib), not the device's own memory.")
    if winner["key"] == result.reference_key:
        notes.append("No measured candidate beat the starting point and passed verification: this card is the "
                     "starting point itself.")
    else:
        notes.append(f"What changed: {describe_changes(winner['changes'])}"
                     f"{'' if result.unfit is None else ' (against the starting point)'}. Why it is faster "
                     f"(measured in the two search trials): {_why(start, winner)}.")
    if gain is not None:
        notes.append(f"Gain measured again, start and winner in turns: {gain.describe()}.")
    if ablations is not None and (ablations.found or ablations.skipped):
        parts = [a.describe() for a in ablations.found]
        if ablations.skipped:
            parts.append("not measured within the budget: " + ", ".join(ablations.skipped))
        notes.append("Each changed knob dropped in turn (one run each): " + "; ".join(parts) + ".")
    for verdict in failed:
        tps = verdict.record["measured"]["tokens_per_s_per_gpu"]
        notes.append(f"Trial {verdict.record['index']} ({describe_changes(verdict.record['changes'])}) measured "
                     f"{tps:,.1f} tokens/s/GPU but failed verification: {'; '.join(verdict.failures)}; the next "
                     "fastest was verified instead.")
    notes.append(f"Status {status}: " + ("the numerics rules, the convergence check against the starting point"
                                         " and, where the optimizer's placement changed, the optimizer component test "
                                         "passed." if status == "verified" else "not every check passed."))
    return notes


def publish(result: SearchResult, winner: Verdict | None, failed: list[Verdict], *, minutes: float,
            gain: Gain | None = None, ablations: Ablations | None = None) -> Published:
    from openrecipes.cards.new import NewCardOptions, new_card
    from openrecipes.site.build import build_site

    out = result.options.out
    start = next(r for r in result.records if r["key"] == result.reference_key)
    record = winner.record if winner else start
    status = "verified" if winner else "unverified"
    candidate = result.candidates[record["key"]]
    figures = headline(result, record, gain, minutes)
    name = safe_name(f"{result.start.name}-tuned")
    tuned = candidate.recipe.model_copy(update={"name": name, "run_dir": f"{result.start.run_dir}-tuned"})
    recipe_path = out / TUNED_FILE
    atomic_write_text(recipe_path, f"# written by openrecipes tune from {result.start_path}; only performance-only "
                      "fields differ from it\n" + dump_recipe(tuned))
    notes = [*notes_for(result, record, status, failed, figures, gain, ablations),
             "The run directories named here (trials/...) are in the tuning output (openrecipes tune --out)."]
    gpu_dir = "cpu" if result.target.is_cpu else result.target.gpu_type.lower()
    catalog = Path("recipes") / safe_name(result.start.model) / gpu_dir
    card = out / catalog / f"{name}.yaml"
    # the winning recipe beside its card (a recipe, not a card: cards.validate skips RECIPE_SUFFIXES), so the card's
    # run works from a repository holding OUT/recipes: its data is the start's section (the build or the rows)
    runnable = catalog / f"{name}{RECIPE_SUFFIXES[0]}"
    atomic_write_text(out / runnable, dump_recipe(tuned))
    run_command = f"openrecipes train {runnable.as_posix()} --nproc {result.target.count}"
    component_tests = (winner.optimizer_report,) if winner and winner.optimizer_report else ()
    card, problems = new_card(NewCardOptions(
        run_dir=out / record["run_dir"], reference=out / start["run_dir"], out=card, author=result.options.author,
        window=result.options.measurement_window(), gpu_memory_gb=gpu_memory_gb(result.target),
        status=status, component_tests=component_tests, overwrite=True, notes=tuple(notes),
        tuning=_tuning_block(result, record["key"], gain, ablations, figures), run_command=run_command, recipe=tuned,
        output_dir=out, samples_tokens_per_s=_winner_samples(gain) if winner else ()))
    errors = [p for p in problems if getattr(p, "severity", "error") == "error"]
    if errors:
        raise ValueError(f"{card}: the card does not validate: {errors[0]}")
    site = build_site(out / "recipes", out / "site").out
    return Published(recipe=recipe_path, card=card, site=site, status=status, figures=figures, notes=notes)
