"""The search: measure the start, rank candidates with the planner, run trials, refit, search around the best.

Order of trials (deterministic given the trials already recorded, so a rerun walks the same path and reuses them):
1. the starting point (when it does not fit, the smallest change of it that does: ``tune/reference.py``); 2.
candidates given with ``--try``; 3. about half of the remaining budget down the planner's ranking (refitted after
every trial); 4. the rest around the best measured recipe: every setting one knob away, and two knobs away from the
most promising of those, best predicted first. The offload fraction and the number of
recomputed layers are solved from the memory model (``tune/solve.py``) for every setting of the other knobs.

``--minutes`` is the wall time of the whole command: ``budget.SearchBudget`` says which trials it holds.

A failed trial is information: after an out-of-memory every candidate predicted to need as much memory or more is
pruned (``Calibration.out_of_memory_gib``), and after any other failure every candidate that makes all the failed
trial's changes is pruned, so no two trials fail the same way for the same reason.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from openrecipes.config.overrides import apply_overrides
from openrecipes.config.recipe import Recipe, dump_recipe, load_recipe, recipe_from_dict
from openrecipes.config.layout import with_world_size
from openrecipes.config.rundir import rows_directory
from openrecipes.tune.budget import SearchBudget
from openrecipes.tune.family_calibration import FamilyMemory
from openrecipes.tune.journal import Journal, check_settings, prepare_out, settings_sha256, write_pruned
from openrecipes.tune.options import TuneOptions
from openrecipes.tune.predict import Calibration, Planner, Prediction, Target, resolve_target
from openrecipes.tune.progress import Progress, failure_text
from openrecipes.tune.reference import ReferenceFallback, UnfitStart
from openrecipes.tune.runner import Outcome, Runner, TrialRun
from openrecipes.tune.screen import Screening
from openrecipes.tune.slurm_runner import CLUSTER_FAILURES, InFlight, SlurmRunner, resumable_trial_dir
from openrecipes.tune.trial import TRIAL_RECIPE, OpenTrial, early_end_s, trial_record, write_trial_recipe
from openrecipes.tune.solve import solved_offload, solved_recompute_layers
from openrecipes.tune.space import (Candidate, ModelFacts, Settings, candidate_recipe,
                                    check_performance_only, describe_changes, first_ranking_space, neighbours,
                                    start_settings)
from openrecipes.verify.rules import compare_recipes

ROWS_DIR = "rows"
TWO_KNOB_SEEDS = 4  # one-knob neighbours that seed two-knob moves


@dataclass(kw_only=True)
class Ranked:
    candidate: Candidate
    prediction: Prediction


@dataclass(kw_only=True)
class SearchResult:
    start: Recipe
    start_path: Path
    target: Target
    records: list[dict[str, Any]]
    candidates: dict[str, Candidate]  # by key, every candidate that was tried
    pruned: int
    calibration: Calibration
    options: TuneOptions
    reference_key: str = "start"  # the trial measured as the start: the start's, or its reference's when it did not fit
    unfit: UnfitStart | None = None  # the start that did not fit, and its reference
    screen: list[dict[str, Any]] | None = None  # --screen: the candidates measured one rank at a time (tune/screen.py)


class Search(SearchBudget, ReferenceFallback, FamilyMemory, Screening):
    def __init__(self, options: TuneOptions, runner: Runner, progress: Progress | None = None) -> None:
        self.options = options
        self.runner = runner
        start = load_recipe(options.start)
        self.target = resolve_target(options.gpus, start.layout, options.nproc)
        layout = with_world_size(start.layout, self.target.count)  # dp left out: the count's, as train does
        self.start = start if layout == start.layout else start.model_copy(update={"layout": layout})
        self.nproc = options.nproc or self.target.count
        if self.nproc > self.target.count:
            raise ValueError(f"--nproc {self.nproc}: the start runs on {self.target.count} process(es) (tp·pp·cp·dp "
                             f"of its layout) and the tuner keeps that world size; to tune on {self.nproc}, give the "
                             f"start a layout of {self.nproc} (dp left out is the world size) and --gpus "
                             f"{self.nproc}x{self.target.gpu_type}")
        if self.nproc != self.target.count:
            raise ValueError(f"--nproc {self.nproc}: this runner starts all {self.target.count} processes of a "
                             "trial on one machine; several nodes need the Slurm runner (docs/tune.md)")
        if isinstance(runner, SlurmRunner):  # the start becomes a job: refused here as train (and launch) refuse it
            from openrecipes.train.cli import check_job_recipe

            check_job_recipe(str(options.start), [], world_size=self.target.count, world_from="--gpus")
        if options.remeasure < 0:
            raise ValueError(f"--remeasure: 0 or more (start, winner) pairs, got {options.remeasure}")
        if options.trials < 1:
            raise ValueError(f"--trials: at least 1 (the starting point), got {options.trials}")
        self.window = options.measurement_window()
        if not 0 <= self.window[0] <= self.window[1] < options.trial_steps:
            raise ValueError(f"--window {self.window[0]} {self.window[1]}: must lie within the "
                             f"{options.trial_steps} trial steps")
        self.out = Path(options.out)
        prepare_out(self.out, Path(options.start))
        self.rows = self._rows()
        from openrecipes.cards.dataset import read_rows_manifest

        # read as the card will read it: rows the card cannot describe are refused now, not after the whole search
        manifest = read_rows_manifest(self.rows)
        row_tokens = int(manifest["row_tokens"])
        self.planner = Planner(self.start, self.target, row_tokens, image_rows=bool(manifest.get("images")),
                               memory_gib=options.gpu_memory_gib)
        shape, workload = self.planner.shape, self.planner.workload(self.start)
        self.facts = ModelFacts(num_layers=shape.num_layers, num_experts=shape.num_experts, kv_heads=shape.kv_heads,
                                row_tokens=row_tokens, world_size=self.target.count,
                                cuda=not self.target.is_cpu, heads=shape.heads, expert_ffn=shape.expert_ffn,
                                image_rows=workload.image_rows,
                                image_first_stage_layers=workload.image_first_stage_layers,
                                attention_sinks=shape.attention_sinks)
        settings = {"start": dump_recipe(self.start), "target": self.target.label(),
                    "trial_steps": options.trial_steps, "window": list(self.window), "rows": str(self.rows),
                    "stable_cv": options.stable_cv}
        if options.gpu_memory_gib is not None:  # it decides the start's reference; absent, older outputs still resume
            settings["gpu_memory_gib"] = options.gpu_memory_gib
        check_settings(self.out, settings)
        # the rows' content as well as their path: trials of other rows are other measurements
        measured_under = settings_sha256({**settings, "rows_sha256": manifest.get("parquet_sha256")})
        self.journal = Journal(self.out, measured_under=measured_under)
        self.progress = progress or Progress(trials=options.trials, minutes=options.minutes)
        self.calibration = self.start_calibration(self.start.model)  # a stored refit of the family, or none
        self.tried: dict[str, Candidate] = {}
        self.reference = Candidate(settings=start_settings(self.start, self.facts), recipe=self.start, changes={})
        self.unfit: UnfitStart | None = None
        self.predicted: dict[Settings, Ranked | None] = {}  # None: refused
        self.solving: dict[Settings, Prediction | None] = {}  # the planner's predictions the solved knobs bisect
        self.refused: dict[str, str] = {}  # for good: train or the planner refuses it, or it would fail as a trial did
        self.passed_over: set[str] = set()  # candidates whose trial did not fit in the time left when next in line
        # every candidate left out, by key, with its latest reason; one predicted not to fit stays a candidate, the
        # refit may later say it fits (its margin refined from measured peaks, say)
        self.pruned: dict[str, dict[str, Any]] = {}
        self.trial_index = 0
        self.searching = True  # False once the search is over: only the card is left to reserve time for
        # several search trials at once (Slurm's --max-parallel); the start, remeasurements and ablations run alone
        self.in_flight = InFlight(runner, runner.max_parallel if isinstance(runner, SlurmRunner) else 1)

    def _rows(self) -> Path:
        """The rows every trial trains on: the start's rows directory, or its data.build built once into OUT."""
        if self.start.data.rows is not None:
            return rows_directory(self.start.data.rows, self.out)
        from openrecipes.data.build import build_recipe_rows

        return build_recipe_rows(self.start.data.build, self.out / ROWS_DIR)

    # ---- candidates -------------------------------------------------------------------------------------------

    def _candidate(self, settings: Settings) -> Candidate | None:
        try:
            return candidate_recipe(self.start, settings, self.facts)
        except ValueError as error:
            if "numerics" in str(error):
                raise  # never expected; a bug in the space, not a candidate to skip
            self._prune(settings, None, f"recipe refused: {error}")
            return None

    def _prune(self, settings: Settings, candidate: Candidate | None, reason: str,
               prediction: Prediction | None = None, *, for_good: bool = True) -> None:
        key = candidate.key if candidate else repr(settings)
        if key in self.refused:
            return
        if for_good:
            self.refused[key] = reason
        self.pruned[key] = {"key": key, "changes": candidate.changes if candidate else None,
                            "label": describe_changes(candidate.changes) if candidate else repr(settings),
                            "reason": reason, "prediction": prediction.to_dict() if prediction else None}

    def _left_out(self) -> list[dict[str, Any]]:
        """The pruned candidates that never ran."""
        return [entry for key, entry in self.pruned.items() if key not in self.tried]

    def _rank_one(self, candidate: Candidate) -> Ranked | None:
        if candidate.key in self.refused:
            return None
        reason = self.planner.refusal(candidate.recipe)
        if reason:
            self._prune(candidate.settings, candidate, f"refused by the layout rules train applies: {reason}")
            return None
        try:
            prediction = self.planner.predict(candidate.recipe)
        except ValueError as error:
            self._prune(candidate.settings, candidate, f"refused by the planner: {error}")
            return None
        return Ranked(candidate=candidate, prediction=prediction)

    def _still_fits(self, ranked: Ranked) -> bool:
        """Whether the candidate fits under the latest refit and fails no way a measured trial did (else pruned:
        for good when it would fail as a trial did)."""
        candidate, prediction = ranked.candidate, ranked.prediction
        if (reason := self._failed_like(candidate)) is not None:
            self._prune(candidate.settings, candidate, reason, prediction)
            return False
        if not self.calibration.leaves_margin(prediction):
            self._prune(candidate.settings, candidate, self.calibration.misfit_reason(prediction), prediction,
                        for_good=False)
            return False
        return True

    def _failed_like(self, candidate: Candidate) -> str | None:
        """Why ``candidate`` would fail as a measured trial did: it makes every change of a trial that failed (other
        than by memory, which the memory bound covers, or by the cluster: a lost node, a preemption, a scancel)."""
        items = candidate.changes.items()
        for record in self.journal.records:
            if (record["status"] == "failed" and record["key"] in self.tried and record["changes"]
                    and record["failure"]["class"] not in ("out_of_memory", *CLUSTER_FAILURES)
                    and all((path, value) in items for path, value in record["changes"].items())):
                return (f"makes every change of trial {record['index']}, which failed "
                        f"({failure_text(record['failure'])})")
        return None

    def _fits(self, settings: Settings) -> bool | None:
        """Whether the memory model says ``settings`` fit with the refit's margin free (None: refused)."""
        if settings not in self.solving:
            candidate = self.candidate_or_none(settings)
            self.solving[settings] = None if candidate is None else self._prediction_or_none(candidate)
        prediction = self.solving[settings]
        return None if prediction is None else self.calibration.leaves_margin(prediction)

    def _solved(self, settings: list[Settings]) -> list[Settings]:
        """The offload fraction and the recomputed layers solved for every distinct setting of the other knobs."""
        found: dict[Settings, None] = {}
        bases = dict.fromkeys(replace(s, offload=0.0) for s in settings)
        for base in bases:
            if self.start.precision == "bf16" and self._fits(base) is False:
                if (solved := solved_offload(base, self._fits)) is not None:
                    found[solved] = None
        for base in dict.fromkeys(replace(s, recompute=("none", "uniform", 1)) for s in settings):
            for solved in solved_recompute_layers(base, self._fits, self.facts.num_layers):
                found[solved] = None
        return list(found)

    def _order(self, ranked: list[Ranked]) -> list[Ranked]:
        """The untried candidates, fastest predicted first, each checked again under the latest refit and failures
        (ranked before an out-of-memory, a candidate may now be above it)."""
        untried = [r for r in ranked if r.candidate.key not in self.tried and r.candidate.key not in self.refused
                   and self._still_fits(r)]
        return sorted(untried, key=lambda r: (-self.calibration.tokens_per_s_per_gpu(r.prediction), r.candidate.key))

    def _around(self, best: Candidate) -> list[Ranked]:
        """Candidates one knob from the best measured (and its offload and recomputed layers solved again under the
        refitted memory model), then two knobs from its most promising neighbours."""
        moves = [s for _, s in neighbours(best.settings, self.start, self.facts)]
        one = self._ranked(moves + self._solved([best.settings]))
        found = {r.candidate.key: r for r in one}
        for seed in self._order(one)[:TWO_KNOB_SEEDS]:
            for r in self._ranked([s for _, s in neighbours(seed.candidate.settings, self.start, self.facts)]):
                found.setdefault(r.candidate.key, r)
        return list(found.values())

    def _ranked(self, settings: list[Settings]) -> list[Ranked]:
        """The candidates of ``settings`` the planner predicts (once each), in order, without repeats."""
        found: dict[str, Ranked] = {}
        for one in dict.fromkeys(settings):
            if one not in self.predicted:
                self.predicted[one] = (c := self._candidate(one)) and self._rank_one(c)
            if (ranked := self.predicted[one]) is not None:
                found.setdefault(ranked.candidate.key, ranked)
        return list(found.values())

    def _given(self, text: str) -> Candidate:
        """A candidate from ``--try "KEY=VALUE ..."``; a numerics field is refused with its rule, every refusal
        naming the --try."""
        try:
            return self._given_candidate(text)
        except ValueError as error:
            raise ValueError(str(error) if str(error).startswith("--try") else f"--try {text!r}: {error}") from None

    def _given_candidate(self, text: str) -> Candidate:
        overrides = shlex.split(text)
        if not overrides or any("=" not in item for item in overrides):
            raise ValueError("expected KEY=VALUE pairs separated by spaces")
        for item in overrides:
            check_performance_only({item.split("=", 1)[0]: None})
        tree = apply_overrides(self.start.model_dump(mode="json"), overrides)
        recipe = recipe_from_dict(tree, source=f"--try {text!r}")
        report = compare_recipes(recipe, self.start)
        if not report.passed:
            raise ValueError(f"--try {text!r}: changes numerics fields " + ", ".join(d.path for d in report.numerics))
        return Candidate(settings=start_settings(recipe, self.facts), recipe=recipe,
                         changes={d.path: d.candidate for d in report.performance})

    # ---- trials -----------------------------------------------------------------------------------------------

    def run_trial(self, candidate: Candidate, prediction: Prediction | None, phase: str,
                  refusal: str | None = None, key: str | None = None) -> dict[str, Any]:
        """Run (or reuse) one trial and record it; ``refusal`` records a layout train would refuse, unrun. A ``key``
        of its own records a repeated measurement of the candidate, which the search and the refit leave aside."""
        opened = self._open_trial(candidate, prediction, phase, key)
        if isinstance(opened, dict):
            return opened
        outcome = (Outcome(failure="refused_layout", detail=refusal) if refusal
                   else self.runner.run(opened.run, tick=self.progress.tick))
        return self._close_trial(opened, outcome)

    def _search_trial(self, candidate: Candidate, prediction: Prediction | None, phase: str,
                      refusal: str | None = None) -> None:
        """A trial of the search: run now, or with several jobs at once (``in_flight``) queued to be collected."""
        if self.in_flight.max_parallel == 1 or refusal:
            self.run_trial(candidate, prediction, phase, refusal=refusal)
        elif not isinstance(opened := self._open_trial(candidate, prediction, phase), dict):
            self.in_flight.submit(opened.run, opened)

    def _collect(self, *, below: int) -> None:
        """Record the trials in flight as they end, until fewer than ``below`` are left."""
        while self.in_flight.count >= max(below, 1):
            self._close_trial(*self.in_flight.collect(self.progress.tick))

    def _open_trial(self, candidate: Candidate, prediction: Prediction | None, phase: str,
                    key: str | None = None) -> dict[str, Any] | OpenTrial:
        """The trial's record when it is reused, else its folder and recipe, ready to run."""
        index = self.trial_index
        self.trial_index += 1
        key = key or candidate.key
        if key == candidate.key:
            self.tried[candidate.key] = candidate
        label = describe_changes(candidate.changes)
        calibrated = self.calibration.tokens_per_s_per_gpu(prediction) if prediction else None
        self.progress.trial_started(index, label, calibrated, phase)
        record = self.journal.find(key)
        if record is not None:
            self.progress.trial_finished(record, reused=True)
            self._refit()
            return record
        # a Slurm job an earlier tuner queued for this trial is followed in its folder, not queued again
        trial_dir = resumable_trial_dir(self.runner, self.journal.trial_dir(index, key))
        if trial_dir is None:
            trial_dir = self.journal.fresh_trial_dir(index, key)
            write_trial_recipe(candidate, trial_dir, self.start.name, self.options.trial_steps, self.rows)
        run = TrialRun(recipe_path=trial_dir / TRIAL_RECIPE, run_dir=trial_dir / "run", nproc=self.nproc,
                       timeout_s=self._timeout(phase), window=self.window, stable_cv=self.options.stable_cv,
                       end_if_slower_than_s=early_end_s(phase, self.journal.records, self.options.stable_cv),
                       steps=self.options.trial_steps)
        return OpenTrial(index=index, key=key, phase=phase, candidate=candidate, label=label, prediction=prediction,
                         calibrated=calibrated, calibration=self.calibration.to_dict(), run=run,
                         calibrated_peak_gib=self.calibration.peak_gib(prediction) if prediction else None,
                         calibrated_allocated_gib=self.calibration.allocated_gib(prediction) if prediction else None)

    def _close_trial(self, opened: OpenTrial, outcome: Outcome) -> dict[str, Any]:
        record = trial_record(opened, outcome, out=self.out, trial_steps=self.options.trial_steps,
                              measured_under=self.journal.measured_under)
        self.journal.append(record)
        self.progress.trial_finished(record, reused=False)
        self._refit()
        return record

    def candidate_or_none(self, settings: Settings) -> Candidate | None:
        try:
            return candidate_recipe(self.start, settings, self.facts)
        except ValueError:
            return None

    def prediction_if_fits(self, candidate: Candidate) -> Prediction | None:
        """The planner's prediction when train would run the candidate and it is predicted to fit, else None."""
        prediction = self._prediction_or_none(candidate)
        return prediction if prediction and self.calibration.leaves_margin(prediction) else None

    def run(self) -> SearchResult:
        refusal = self.planner.refusal(self.start)
        if refusal:  # the rules train applies: running it would only show train refusing it
            raise ValueError(f"the starting point: openrecipes train refuses its layout: {refusal}")
        start_prediction = self.planner.predict(self.start)
        for text in self.options.tries:  # each --try read and checked before any trial, the start's included
            if refusal := self.planner.refusal(self._given(text).recipe):
                raise ValueError(f"--try {text!r}: openrecipes train refuses its layout: {refusal}")
        if note := self.planner.device_memory_note():
            self.progress.say(note)
        self.progress.say(f"tuning {self.options.start} on {self.target.label()}: {self.options.trials} trials, "
                          f"{self.options.minutes:g} minutes, {self.options.trial_steps} steps per trial, window "
                          f"steps {self.window[0]}-{self.window[1]}; writing {self.out}")
        screen = self.screen_candidates() if self.options.screen else None  # before any trial of the fleet
        self.measure_start(self.reference, start_prediction)  # the start, or the reference when it does not fit
        with self.in_flight:  # a job in flight is cancelled if the search stops
            self._search()
        self.progress.projected_finish(self.reserve_s())
        self.searching = False
        write_pruned(self.out, self._left_out())
        return SearchResult(start=self.start, start_path=Path(self.options.start), target=self.target,
                            records=[r for r in self.journal.records if r["key"] in self.tried],
                            candidates=self.tried, pruned=len(self._left_out()), calibration=self.calibration,
                            options=self.options, reference_key=self.reference.key, unfit=self.unfit,
                            screen=screen)

    def _search(self) -> None:
        """The trials after the start: the given candidates, the planner's ranking, then around the best."""
        for text in self.options.tries:
            given = self._given(text)
            prediction = self._prediction_or_none(given)
            if given.key in self.refused:  # its ranks, measured alone (--screen), do not fit
                self.progress.say(f"--try {text!r}: pruned: {self.refused[given.key]}")
            elif given.key in self.tried:
                self.progress.say(f"--try {text!r}: measured already (the start, or an earlier --try)")
            elif self._budget_left(prediction, given.settings):
                self._search_trial(given, prediction, "given", refusal=self.planner.refusal(given.recipe))
            else:
                self.progress.say(f"--try {text!r}: not run: the time left does not hold its trial")
        space = self.first_space()
        ranked, solved_under = self._ranked(space + self._solved(space)), self.calibration.memory_model()
        self.progress.say(f"{len(self._order(ranked))} candidates ranked by the planner, {len(self._left_out())} "
                          f"left out so far (the card counts those left out by the end; reasons in "
                          f"{self.out / 'pruned.jsonl'})")
        first_phase = self.trial_index + math.ceil((self.options.trials - self.trial_index) / 2)
        while self.trial_index < self.options.trials:
            self._collect(below=self.in_flight.max_parallel)  # room for one more
            if self.calibration.memory_model() != solved_under:  # a refit moved it: the solved knobs move with it
                ranked, solved_under = self._ranked(space + self._solved(space)), self.calibration.memory_model()
            pool: list[Ranked] = []
            if self.trial_index >= first_phase and (best := self._best()):
                pool = self._order(self._around(best[0]))
            pool = pool or self._order(ranked)
            chosen = self._first_within_budget(pool)
            if chosen is None and self.in_flight.count:
                self._collect(below=self.in_flight.count)  # the next to end refits: then look again
                continue
            if not pool:
                self.progress.say("no untried candidate left")
                break
            if chosen is None:
                self.progress.say(self._spent(pool[0].prediction, pool[0].candidate.settings))
                break
            self._search_trial(chosen.candidate, chosen.prediction, "ranked" if self.trial_index < first_phase
                               else "around-best")
        self._collect(below=1)

    def first_space(self) -> list[Settings]:
        """The settings of the planner's first ranking."""
        return list(first_ranking_space(self.start, self.facts, with_compile=self.planner.compile_prior is not None))

    def _first_within_budget(self, pool: list[Ranked]) -> Ranked | None:
        """The fastest predicted candidate whose trial fits in the time left. Those ahead of it that do not (a first
        compile late in the budget, say) are said once and stay in the pool."""
        chosen = next((r for r in pool if self._budget_left(r.prediction, r.candidate.settings)), None)
        for ranked in pool[:pool.index(chosen)] if chosen else []:
            if ranked.candidate.key not in self.passed_over:
                self.passed_over.add(ranked.candidate.key)
                self.progress.say(f"passed over {describe_changes(ranked.candidate.changes)}: its trial "
                                  + self._needs(ranked.prediction, ranked.candidate.settings))
        return chosen

    def _prediction_or_none(self, candidate: Candidate) -> Prediction | None:
        if self.planner.refusal(candidate.recipe):
            return None
        try:
            return self.planner.predict(candidate.recipe)
        except ValueError:
            return None
