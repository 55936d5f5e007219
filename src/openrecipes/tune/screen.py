"""Screening by a measured rank (``openrecipes tune --screen N``): before any trial of the whole fleet, the start and
the planner's first N candidates are built one rank at a time on this machine under PyTorch's fake process group
(``train/rank_measure.py``, what ``openrecipes measure-rank`` runs), each rank's peak memory and compute measured; a
candidate whose heaviest measured rank does not fit the device with the tuner's memory margin free is pruned with
that measurement as its reason, as the planner's prunes are (``pruned.jsonl``).

What a rank measured alone tells is its memory, exactly, and its compute without communication; not communication,
its overlap, pipeline bubbles across ranks or stragglers (docs/plan.md, "One rank measured alone"). So the screen
only prunes, by memory; the ranking stays the planner's (refitted by trials), and the screen's figures are kept
apart from the fleet's: ``screen.jsonl``, ``tune.json``'s ``result.screen`` and the card's ``tuning.screen``.

When the fleet cannot run here (a local runner and fewer GPUs on this machine than the world size), the tuner
screens and stops (``screen_only``): no trial, no card; ``OUT/screened.yaml`` is the fastest predicted candidate
whose measured ranks fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openrecipes.tune.predict import Prediction
from openrecipes.tune.space import Candidate, describe_changes
from openrecipes.utils import atomic_write_text, iter_json_lines

SCREEN_FILE = "screen.jsonl"
SCREEN_DIR = "screen"
SCREENED_FILE = "screened.yaml"  # screen-only: the fastest predicted candidate whose measured ranks fit
SCREEN_STEPS = 3  # per rank: a warm-up left out of the times, then two timed steps


class RankMeasurer(Protocol):
    def measure(self, recipe_path: Path, rank: int, world: int, out: Path) -> dict[str, Any]:
        """One rank's record (``train/rank_measure.py`` ``measure_rank``'s)."""


class ProcessMeasurer:
    """Each rank in its own process (so each peak is that rank's), as ``openrecipes measure-rank`` runs them."""

    def __init__(self, steps: int = SCREEN_STEPS, timeout_s: float = 900.0) -> None:
        self.steps, self.timeout_s = steps, timeout_s

    def measure(self, recipe_path: Path, rank: int, world: int, out: Path) -> dict[str, Any]:
        from openrecipes.train.rank_cli import measure_in_process

        return measure_in_process(recipe_path, rank, world, out, steps=self.steps, timeout_s=self.timeout_s)


class ScreenRecord(BaseModel):
    """One line of ``screen.jsonl``: a candidate's ranks measured alone, and whether the heaviest fits."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(min_length=1)
    label: str
    changes: dict[str, Any]
    layout: str
    world_size: int = Field(ge=1)
    device: str  # where the ranks were measured: "cpu" or "cuda:0"
    capacity_gib: float = Field(gt=0)
    margin: float = Field(ge=0, lt=1)
    peak_gib: float = Field(ge=0)  # the heaviest rank's, with the CUDA context on a GPU
    peak_rank: int = Field(ge=0)
    fits: bool
    reason: str | None
    # the planner's tokens/s/GPU under the refit it was screened with: how screen-only mode picks among those that fit
    predicted_tokens_per_s_per_gpu: float = Field(gt=0)
    ranks: list[dict[str, Any]] = Field(min_length=1)  # rank_cli.beside_plan's records, measured beside predicted
    measured_under: str = Field(pattern=r"^[0-9a-f]{64}$")


def read_screen(out: Path, measured_under: str) -> dict[str, dict[str, Any]]:
    """The screened candidates recorded in ``out`` for this start, by key; a record of another start is refused."""
    path, found = out / SCREEN_FILE, {}
    if not path.exists():
        return found
    for line, record in iter_json_lines(path):
        try:
            typed = ScreenRecord.model_validate(record)
        except ValidationError as error:
            item = error.errors()[0]
            raise ValueError(f"{path}:{line}: not a screen record of this openrecipes tune "
                             f"({'.'.join(map(str, item['loc']))}: {item['msg']}); choose another --out") from None
        if typed.measured_under != measured_under:
            raise ValueError(f"{path}:{line}: candidate {typed.key} was screened for another start, target or "
                             "rows; choose another --out")
        found[typed.key] = record
    return found


def screen_verdict(ranks: list[dict[str, Any]], capacity_gib: float, margin: float,
                   context_gib: float) -> tuple[float, int, str | None]:
    """(the heaviest rank's peak, its rank, why it does not fit or None). On a GPU what must fit is the allocator's
    reserved peak and the CUDA context outside it (as the tuner's memory model counts it, ``Calibration.peak_gib``);
    on CPU the process's resident peak."""
    from openrecipes.train.rank_cli import rank_peak_gib

    def need(r: dict[str, Any]) -> float:
        return rank_peak_gib(r) + (context_gib if "peak_reserved_gib" in r else 0.0)

    heaviest = max(ranks, key=need)
    peak, limit = need(heaviest), capacity_gib * (1.0 - margin)
    if peak <= limit:
        return peak, heaviest["rank"], None
    return peak, heaviest["rank"], (f"measured rank {heaviest['rank']} peak {peak:.3f} GiB > {limit:.3f} GiB "
                                    f"({capacity_gib:g} GiB with {100 * margin:.3g} % left free; one rank measured "
                                    "alone, openrecipes tune --screen)")


class Screening:
    """The screen as the search runs it (a part of ``tune.search.Search``)."""

    screened: dict[str, dict[str, Any]]
    screened_candidates: dict[str, Candidate]
    rank_measurer: RankMeasurer | None = None  # None: each rank in its own process (ProcessMeasurer)

    def screen_candidates(self) -> list[dict[str, Any]]:
        """Measure the ranks of the start, the ``--try`` candidates and the planner's first ``--screen``
        candidates; prune those that do not fit. Returns the records in screening order (the start first); reused
        from ``screen.jsonl`` where recorded."""
        measurer = self.rank_measurer or ProcessMeasurer(timeout_s=self.options.trial_timeout_s)
        self.screened = read_screen(self.out, self.journal.measured_under)
        self.screened_candidates = {}
        space = self.first_space()
        shortlist = list(self._order(self._ranked(space + self._solved(space))))[:self.options.screen]
        start = self.reference
        given = [(c, p) for c in map(self._given, self.options.tries)
                 if (p := self._prediction_or_none(c)) is not None]  # one train refuses is refused as its trial
        pending = list({c.key: (c, p) for c, p in [(start, self.planner.predict(start.recipe)), *given,
                                                   *((r.candidate, r.prediction) for r in shortlist)]}.values())
        self.progress.say(f"screening {len(pending)} candidates (the start, {len(given)} given with --try and the "
                          f"planner's first {len(shortlist)}) by ranks measured alone on this machine")
        records = []
        for number, (candidate, prediction) in enumerate(pending, 1):
            self.screened_candidates[candidate.key] = candidate
            record = self.screened.get(candidate.key)
            if record is None:
                try:
                    record = self._screen_one(candidate, prediction, measurer)
                except ValueError as error:  # this machine could not measure it (its own device too small, say)
                    self.progress.say(f"screened {number} of {len(pending)}: {describe_changes(candidate.changes)}: "
                                      f"not measured ({error}); left to the planner")
                    continue
                self.screened[candidate.key] = record
                atomic_write_text(self.out / SCREEN_FILE, "".join(json.dumps(r, sort_keys=True) + "\n"
                                                                  for r in self.screened.values()))
            records.append(record)
            verdict = "fits" if record["fits"] else f"pruned: {record['reason']}"
            self.progress.say(f"screened {number} of {len(pending)}: {record['label']} ({record['layout']}): peak "
                              f"{record['peak_gib']:.3f} GiB on rank {record['peak_rank']}; {verdict}")
            if not record["fits"] and candidate.key != start.key:  # the start is measured as it is, by its trial
                self._prune(candidate.settings, candidate, record["reason"], prediction)
        return records

    def _screen_one(self, candidate: Candidate, prediction: Prediction, measurer: RankMeasurer) -> dict[str, Any]:
        from openrecipes.train.rank_cli import beside_plan, default_ranks
        from openrecipes.tune.trial import write_trial_recipe

        folder = self.out / SCREEN_DIR / candidate.key
        folder.mkdir(parents=True, exist_ok=True)
        recipe_path = write_trial_recipe(candidate, folder, self.start.name, self.options.trial_steps, self.rows)
        world = self.target.count
        plan = self.planner.plan(candidate.recipe)
        ranks = [beside_plan(measurer.measure(recipe_path, rank, world, folder / f"rank-{rank}.json"), plan)
                 for rank in default_ranks(candidate.recipe.layout, self.facts.num_layers)]
        margin = self.calibration.memory_margin
        peak, peak_rank, reason = screen_verdict(ranks, prediction.capacity_gib, margin, prediction.context_gib)
        return ScreenRecord(key=candidate.key, label=describe_changes(candidate.changes), changes=candidate.changes,
                            layout=candidate.recipe.layout.label(), world_size=world, device=ranks[0]["device"],
                            capacity_gib=prediction.capacity_gib, margin=margin, peak_gib=peak, peak_rank=peak_rank,
                            fits=reason is None, reason=reason, ranks=ranks,
                            predicted_tokens_per_s_per_gpu=self.calibration.tokens_per_s_per_gpu(prediction),
                            measured_under=self.journal.measured_under).model_dump(mode="json")


def screen_block(records: list[dict[str, Any]], trials: dict[str, int] | None = None) -> dict[str, Any]:
    """The card's ``tuning.screen`` and ``tune.json``'s ``result.screen``: what was measured on one rank alone,
    per candidate, apart from the fleet's figures; ``trials`` names the trial each candidate later ran as."""
    from openrecipes.train.rank_cli import rank_peak_gib

    first = records[0]
    candidates = []
    for record in records:
        ranks = [{"rank": r["rank"], "stage": r["pp_rank"], "peak_gib": rank_peak_gib(r),
                  "compute_s": r["measured_compute_s"], "optimizer_s": r["phases_s"].get("optimizer", 0.0)}
                 for r in record["ranks"]]
        candidates.append({"changes": record["label"], "layout": record["layout"], "fits": record["fits"],
                           "reason": record["reason"], "trial": (trials or {}).get(record["key"]), "ranks": ranks})
    return {"measured_on": "one rank", "world_size": first["world_size"], "device": first["device"],
            "peak": "cuda_reserved" if "peak_reserved_gib" in first["ranks"][0] else "process_resident",
            "capacity_gib": first["capacity_gib"], "margin": first["margin"], "candidates": candidates}


def screen_note(block: dict[str, Any]) -> str:
    """The card's sentence saying which figures were measured on one rank and which on the whole fleet."""
    pruned = sum(not c["fits"] for c in block["candidates"])
    peak = ("the CUDA allocator's reserved peak" if block["peak"] == "cuda_reserved"
            else "the process's resident peak, interpreter included")
    return (f"Screened before any trial (openrecipes tune --screen): {len(block['candidates'])} candidates measured "
            f"one rank at a time on {block['device']} under a fake process group of {block['world_size']} "
            f"({pruned} pruned as not fitting); the figures under tuning.screen (peak memory: {peak}; compute "
            "without communication) are one rank's, every other figure of this card (the trials, the result) was "
            "measured on the whole fleet.")


def fleet_out_of_reach(target: Any, runner: Any) -> bool:
    """Whether the trials cannot run the fleet: a local runner and fewer GPUs on this machine than the world size
    (a CPU target runs its processes here; a Slurm runner elsewhere)."""
    from openrecipes.tune.runner import LocalRunner

    if target.is_cpu or not isinstance(runner, LocalRunner):
        return False
    import torch

    return torch.cuda.device_count() < target.count


def screen_only(search: Any) -> int:
    """Screen without trials (the fleet is not on this machine): the records, the prunes and, of the candidates
    whose measured ranks fit, the fastest predicted as ``OUT/screened.yaml``; no card, nothing was measured on the
    fleet. Exit status 0, or 2 when nothing screened fits."""
    from openrecipes.config.recipe import dump_recipe
    from openrecipes.tune.journal import record_result, write_pruned

    out, target = search.out, search.target
    search.progress.say(f"{target.label()} is not on this machine ({_local_gpus()}): screening only, no trial")
    records = search.screen_candidates()
    write_pruned(out, search._left_out())
    fitting = [r for r in records if r["fits"]]
    result: dict[str, Any] = {"outcome": "screened", "screen": screen_block(records),
                              "why": f"{target.label()} is not on this machine: ranks screened, no trial run"}
    if not fitting:
        record_result(out, result)
        print(f"openrecipes tune: no screened candidate fits {target.label()}: every measured rank's peak is above "
              f"what the memory margin leaves ({out / SCREEN_FILE})")
        return 2
    best = max(fitting, key=lambda r: r["predicted_tokens_per_s_per_gpu"])
    recipe = search.screened_candidates[best["key"]].recipe
    path = out / SCREENED_FILE
    atomic_write_text(path, f"# written by openrecipes tune --screen from {search.options.start}: the fastest "
                      "predicted candidate whose ranks, measured alone, fit\n" + dump_recipe(recipe))
    record_result(out, {**result, "best": best["label"], "recipe": str(path)})
    pruned = len(records) - len(fitting)
    print(f"openrecipes tune: screened {len(records)} candidates on one rank each ({pruned} do not fit); the fastest "
          f"predicted that fits: {best['label']} ({best['layout']}, peak {best['peak_gib']:.3f} GiB on rank "
          f"{best['peak_rank']})\n  recipe   {path}\n  screen   {out / SCREEN_FILE}\n  pruned   {out / 'pruned.jsonl'}")
    return 0


def _local_gpus() -> str:
    import torch

    count = torch.cuda.device_count()
    return f"{count} GPU{'s' * (count != 1)} here" if count else "no GPU here"
