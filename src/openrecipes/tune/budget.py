"""The tuner's clock: what a trial is expected to take, and what the search holds back for the verification, the
remeasured pairs and the card that follow it (``--minutes`` is the wall time of the whole command); ``SearchBudget``
keeps that clock for a running search."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from openrecipes.tune.journal import Journal
from openrecipes.tune.options import TuneOptions
from openrecipes.tune.predict import Calibration, Prediction, Target
from openrecipes.tune.progress import Progress
from openrecipes.tune.runner import STABLE_MIN_STEPS
from openrecipes.tune.space import Candidate, Settings

# verification besides the remeasured trials: the optimizer component test, the card and the site, in seconds
# (the component test took 11.6 s on two CPU cores; on one H200 210 s at the full CUDA shape, which the tuner no
# longer runs (tune/verification.py TUNER_COMPONENT_TEST); 60 s holds its eighth of the expert weights)
VERIFY_FIXED_S = {"cpu": 30.0, "gpu": 60.0}
CARD_S = 15.0  # the card and the site, what is left after the remeasurement
# what the first compile of a candidate's blocks adds to its trial, beyond the eager start's cost outside its steps,
# until a compiled trial was measured (one H200, 48 layers of LoRA, calls zz4 and zz5: 28-30 s, FlexAttention's 55 s)
FIRST_COMPILE_S = 30.0
# a next trial predicted at least this fraction of the best measured throughput may become the winner, so its rerun is
# reserved; one predicted slower is not. (One H200, 2026-12-04: call b's ranked trials predicted within 6.2 % of the
# measured, its ablation 15 % high; call a's first compiled trial, before any was measured, 16 % low. A winner missed
# by this rule costs its rerun beyond the best's, at most.)
CONTENDER_FRACTION = 0.9


def verify_fixed_s(on_cpu: bool) -> float:
    return VERIFY_FIXED_S["cpu" if on_cpu else "gpu"]


def pairs_reserve_s(start_wall_s: float, winner_wall_s: float, remeasure: int, on_cpu: bool) -> float:
    """One remeasured (start, winner) pair, the least an honest gain needs (more are taken after the search as time
    allows), and the rest of verification."""
    return min(1, remeasure) * (start_wall_s + winner_wall_s) + verify_fixed_s(on_cpu)


def remeasure_pairs(pair_wall_s: float, left_s: float, remeasure: int, on_cpu: bool) -> int:
    """How many (start, winner) pairs to measure again: as many as ``remeasure`` asks that the time left holds after
    the rest of verification, and at least one."""
    fits = int((left_s - verify_fixed_s(on_cpu)) // max(pair_wall_s, 1e-9))
    return max(min(1, remeasure), min(remeasure, fits))


def rerun_wall_s(record: dict[str, Any], start: dict[str, Any], compile_cache_shared: bool,
                 stable_cv: float | None = None) -> float:
    """What measuring ``record``'s trial again is expected to take: its wall time, less what its first step took
    beyond the start's where the compile cache is shared (its shapes are traced by then; a trial of another node
    may compile again), and less the window steps past the fewest an early end needs where its measured window was
    stable (``stable_cv``: a remeasured run ends at the first stable window, tune/trial.early_end_s)."""
    wall = record["wall_s"]
    if compile_cache_shared:
        first = lambda r: (r.get("startup_s") or {}).get("first_step", 0.0)  # noqa: E731
        wall -= max(0.0, first(record) - first(start))
    measured = record.get("measured") or {}
    window, cv = measured.get("window"), measured.get("step_time_cv")
    if stable_cv is not None and window and cv is not None and cv <= stable_cv:
        wall -= max(0, window[1] - window[0] + 1 - STABLE_MIN_STEPS) * measured["step_time_mean_s"]
    return wall


def outside_steps_s(record: dict[str, Any], trial_steps: int) -> float:
    """A measured trial's time before, around and after its steps: its record's ``overhead_s`` (tune/trial.py), or
    for a record without one its ``trial_steps`` at their measured mean taken from its wall time."""
    if record.get("overhead_s") is not None:
        return record["overhead_s"]
    return max(0.0, record["wall_s"] - trial_steps * record["measured"]["step_time_mean_s"])


def compiled_graphs(settings: Settings) -> Settings:
    """What a compiled trial's graphs depend on: every knob but the optimizer offload's, which runs outside them."""
    return replace(settings, offload=0.0, offload_update="device", overlap=False)


def compile_s(measured: list[tuple[Settings, float]], settings: Settings, cache_shared: bool) -> float:
    """What compiling adds to a trial of ``settings`` beyond an eager start, from ``measured`` (settings, extra
    seconds) of the compiled trials run: the least of those with the same graphs where trials share a compile cache
    (traced once already), else the most of any (a first compile), else FIRST_COMPILE_S."""
    same = [extra for other, extra in measured if compiled_graphs(other) == compiled_graphs(settings)]
    if cache_shared and same:
        return min(same)
    return max((extra for _, extra in measured), default=FIRST_COMPILE_S)


def start_outside_s(start: dict[str, Any], trial_steps: int, offload_share: float = 1.0) -> float:
    """The start's cost outside its steps for a trial offloading ``offload_share`` of what the start offloads: the
    optimizer's set-up (startup phase "optimizer", mostly pinning host memory for the offloaded state) scales with it.
    (One H200, 22 layers, call b: 17.1 s at the start's 1.0, 4.8 s at 0.55, 1.2 s at 0.15.)"""
    optimizer = (start.get("startup_s") or {}).get("optimizer", 0.0)
    return max(0.0, outside_steps_s(start, trial_steps) - optimizer * (1.0 - offload_share))


def estimated_wall_s(start: dict[str, Any], trial_steps: int, step_time_s: float | None,
                     compile_extra_s: float = 0.0, offload_share: float = 1.0) -> float:
    """A trial's expected wall time from the start's measured record: its cost before and around its steps, what
    compiling adds, and the predicted steps (``step_time_s`` None: the start's own wall time)."""
    if step_time_s is None:
        return start["wall_s"] + compile_extra_s
    return start_outside_s(start, trial_steps, offload_share) + compile_extra_s + trial_steps * step_time_s


class SearchBudget:
    """The clock of a ``Search``, a mixin reading the search's state (the attributes below): a trial starts only when
    its estimated time (the start's cost outside its steps, what compiling adds, and its predicted steps) and the
    reserve for verification and remeasurement (``reserve_s``) fit in what is left, and its time limit ends where the
    reserve begins."""

    options: TuneOptions
    runner: Any  # a tune.runner Runner; ``compile_cache_shared`` where its trials share one compile cache
    target: Target
    reference: Candidate  # the trial measured as the start (the start itself, or its reference: tune/reference.py)
    journal: Journal
    progress: Progress
    calibration: Calibration
    tried: dict[str, Candidate]
    trial_index: int
    searching: bool

    def _measured(self, key: str) -> dict[str, Any] | None:
        record = self.journal.find(key)
        return record if record is not None and record["status"] == "ok" else None

    def _best(self) -> tuple[Candidate, float] | None:
        ok = [(r["measured"]["tokens_per_s_per_gpu"], r["key"]) for r in self.journal.records
              if r["status"] == "ok" and r["key"] in self.tried]
        if not ok:
            return None
        tps, key = max(ok)
        return self.tried[key], tps

    def _timeout(self, phase: str) -> float:
        """The trial's limit: ``--trial-timeout``, three times the start's time once it was measured (at least two
        minutes), and for a search trial never past the point where the budget's reserve begins (a remeasurement
        is what the reserve is for: cutting it would leave the gain unmeasured)."""
        limit = self.options.trial_timeout_s
        if phase != "remeasure":
            limit = min(limit, max(1.0, self.progress.left_s() - self.reserve_s()))
        start = self._measured(self.reference.key)
        if start is None:
            return limit
        # a candidate three times slower than the (deliberately slow) start is not worth waiting for
        return min(limit, max(120.0, 3.0 * start["wall_s"]))

    def reserve_s(self, next_wall_s: float = 0.0, next_prediction: Prediction | None = None) -> float:
        """Time held back for what follows the search: the remeasured (start, winner) pairs at their measured
        trial times (the slower of the best candidate so far and the next trial, ``next_wall_s`` to run it again,
        standing in for the winner unless it is predicted too slow to become one) and the rest of verification."""
        start = self._measured(self.reference.key)
        if start is None:
            return 0.0
        if not self.searching:
            return CARD_S
        best = self._best()
        best_wall = (self._rerun_wall_s(self._measured(best[0].key)) if best and best[0].key != self.reference.key
                     else 0.0)
        if next_prediction is not None and best is not None and (
                self.calibration.tokens_per_s_per_gpu(next_prediction) < CONTENDER_FRACTION * best[1]):
            next_wall_s = 0.0  # not a contender: nothing of it to remeasure
        winner_wall = max(best_wall, next_wall_s)
        if not winner_wall:
            return CARD_S  # nothing but the start was measured: nothing to remeasure
        return pairs_reserve_s(self._rerun_wall_s(start), winner_wall, self.options.remeasure, self.target.is_cpu)

    def remeasure_pairs(self, winner: dict[str, Any]) -> int:
        """The module's ``remeasure_pairs`` for this search's start and ``winner``."""
        pair = self._rerun_wall_s(self._measured(self.reference.key)) + self._rerun_wall_s(winner)
        return remeasure_pairs(pair, self.progress.left_s(), self.options.remeasure, self.target.is_cpu)

    @property
    def _cache_shared(self) -> bool:
        return getattr(self.runner, "compile_cache_shared", False)

    def _rerun_wall_s(self, record: dict[str, Any]) -> float:
        return rerun_wall_s(record, self._measured(self.reference.key), self._cache_shared, self.options.stable_cv)

    def _compile_s(self, prediction: Prediction | None, settings: Settings | None) -> float:
        """What compiling adds to the trial of ``settings`` (predicted ``prediction``) beyond the start's cost: 0
        for an eager trial or a compiled start (its measured cost holds a compile already)."""
        if prediction is None or not prediction.compiled or settings is None or self.reference.recipe.kernels.compile:
            return 0.0
        start, steps = self._measured(self.reference.key), self.options.trial_steps
        measured = []
        for record in self.journal.records:
            if record["status"] == "ok" and record["key"] in self.tried and (record.get("prediction") or {}).get(
                    "compiled"):
                trial = self.tried[record["key"]].settings
                expected = start_outside_s(start, steps, self._offload_share(trial))
                measured.append((trial, max(0.0, outside_steps_s(record, steps) - expected)))
        return compile_s(measured, settings, self._cache_shared)

    def _offload_share(self, settings: Settings | None) -> float:
        """The trial's offloaded optimizer state as a share of the measured start's (1 where it offloads none)."""
        start = self.reference.recipe.offload.fraction
        return 1.0 if settings is None or start <= 0 else settings.offload / start

    def estimated_wall_s(self, prediction: Prediction | None, settings: Settings | None = None) -> float:
        """A trial's expected wall time (the module's ``estimated_wall_s``); 0 before the start was measured."""
        return self._walls(prediction, settings)[0]

    def _walls(self, prediction: Prediction | None, settings: Settings | None) -> tuple[float, float]:
        """A trial's expected wall time, and to run it again (its compile traced once where trials share a cache)."""
        start = self._measured(self.reference.key)
        if start is None:
            return 0.0, 0.0
        step_time = self.calibration.step_time_s(prediction) if prediction is not None else None
        extra = self._compile_s(prediction, settings)
        wall = estimated_wall_s(start, self.options.trial_steps, step_time, extra, self._offload_share(settings))
        return wall, wall - extra if self._cache_shared else wall

    def _time_needed(self, prediction: Prediction | None, settings: Settings | None) -> tuple[float, float]:
        """(the trial's expected wall time, the reserve that must be left after it)."""
        wall, rerun = self._walls(prediction, settings)
        return wall, self.reserve_s(rerun, prediction)

    def within_budget(self, prediction: Prediction | None = None, settings: Settings | None = None) -> bool:
        return sum(self._time_needed(prediction, settings)) <= self.progress.left_s()

    def _budget_left(self, prediction: Prediction | None = None, settings: Settings | None = None) -> bool:
        return self.trial_index < self.options.trials and self.within_budget(prediction, settings)

    def _spent(self, prediction: Prediction | None, settings: Settings | None = None) -> str:
        """Why the search stops when the next trial, predicted ``prediction``, is not ``_budget_left``."""
        return "the budget is spent: the next trial " + self._needs(prediction, settings)

    def _needs(self, prediction: Prediction | None, settings: Settings | None = None) -> str:
        """What a trial would take against what is left, in words."""
        wall, reserve = self._time_needed(prediction, settings)
        return (f"would take about {wall:.0f} s and {reserve:.0f} s would be reserved for verification, "
                f"{max(0.0, self.progress.left_s()):.0f} s are left")
