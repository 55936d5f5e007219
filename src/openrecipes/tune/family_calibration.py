"""The refit a tuning leaves for the next one of the same model family: ``calibration.json`` in the tuner's output.

The planner's throughput model is one set of numbers for every family, and its error differs by family, so
without a stored refit a tuning's first prediction is only as good as that shared model. After every refit the tuner
writes what it learned (``FamilyCalibration``): the family, the model, the GPU type, the engine version and a key of
the planner's hardware record (the refit corrects *that* prediction: under another it means nothing), the refit's
fields, and per trial the planner's prediction, the one the trial was chosen under and the refit's against the
measurement, so the improvement can be read from the file.

``openrecipes tune --calibration PATH`` (repeatable: a file, a tuner output, or a directory of tuner outputs) starts
the new run's calibration from such a file: used only when its family, GPU type and planner key are the run's (else
a one-line note says which differs), the step-time refit and the measured compile speedup always, the memory offset
only for the same model (it is a fixed amount of that model's error, in GiB). The run's own refit then replaces it
from its first measured trial, as without a file.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from openrecipes.tune.journal import CALIBRATION_FILE, Journal, _first_error
from openrecipes.tune.options import TuneOptions
from openrecipes.tune.predict import Calibration, Planner, Prediction, Target, fit_calibration
from openrecipes.tune.progress import Progress
from openrecipes.tune.space import Candidate
from openrecipes.tune.trial import peak_under_prediction
from openrecipes.utils import atomic_write_text, read_json
from openrecipes.version import __version__

FORMAT = "openrecipes-tune-calibration"
VERSION = 1
# a calibration file is a few kilobytes; anything far larger is not one, and is not read into memory
MAX_FILE_BYTES = 4 * 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Refit(_Strict):
    """The fields of ``predict.Calibration`` a later run may start from. The out-of-memory bound and the margin are
    left out: they bound one run's workload and region, not the family's."""

    step_scale: float = Field(gt=0)
    per_layer_microbatch_s: float = Field(ge=0)
    # the scale alone, fitted as one ratio over the same trials: for another model of the family, whose layers and
    # microbatches cost another fixed amount than this model's
    one_ratio_step_scale: float = Field(gt=0)
    compile_speedup: float = Field(gt=0)
    compile_measured: bool  # eager and compiled trials were both measured: the speedup is not the prior
    memory_offset_gib: float
    compiled_saving_bytes: float
    reserve_ratio: tuple[float | None, float | None]
    fitted_on: int = Field(ge=1)

    @field_validator("reserve_ratio")
    @classmethod
    def _ratio(cls, value: tuple[float | None, float | None]) -> tuple[float | None, float | None]:
        if any(r is not None and r < 1 for r in value):
            raise ValueError("a peak reserved / peak allocated ratio is at least 1")
        return value


class TrialPrediction(_Strict):
    trial: int = Field(ge=0)
    label: str
    compiled: bool
    planner_tokens_per_s_per_gpu: float = Field(gt=0)  # the planner's, before any refit
    predicted_tokens_per_s_per_gpu: float | None = Field(default=None, gt=0)  # under the refit it was chosen with
    refit_tokens_per_s_per_gpu: float = Field(gt=0)  # under this file's refit
    measured_tokens_per_s_per_gpu: float = Field(gt=0)


class StartPrediction(_Strict):
    """The run's start (or the reference measured in its place): predicted before any trial of its own."""

    trial: int = Field(ge=0)
    calibration_file: str | None  # where its prediction's calibration came from; None: the planner's alone
    planner_tokens_per_s_per_gpu: float = Field(gt=0)
    predicted_tokens_per_s_per_gpu: float = Field(gt=0)
    measured_tokens_per_s_per_gpu: float = Field(gt=0)
    predicted_error: float  # predicted / measured - 1
    planner_error: float


class FamilyCalibration(_Strict):
    format: Literal[FORMAT]
    version: Literal[VERSION]
    family: str = Field(min_length=1)
    model: str = Field(min_length=1)
    gpu_type: str = Field(min_length=1)
    engine_version: str
    planner_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    written: str
    refit: Refit
    trials: list[TrialPrediction] = Field(min_length=1)
    start: StartPrediction | None = None


def planner_key(planner: Planner) -> str:
    """The sha256 of what the planner's step time rests on for this GPU: the engine version and the hardware record,
    less the device's memory (``--gpu-memory-gib``, a CPU host's share), which moves peaks, not step times."""
    record = dataclasses.asdict(planner.hardware)
    record["gpu"] = {k: v for k, v in record["gpu"].items() if k not in ("memory_gib", "memory_gb", "source")}
    return hashlib.sha256(json.dumps([__version__, record], sort_keys=True, default=str).encode()).hexdigest()


def family_name(planner: Planner) -> str:
    """The registry's family of the planner's model (``ModelFamily.name``)."""
    from openrecipes.models.families import family_for_config

    return family_for_config(planner.config).name


def read_calibration(path: Path) -> FamilyCalibration:
    """A calibration file, validated; a ValueError of one line naming the file and the field otherwise."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise ValueError(f"--calibration {path}: cannot be read ({error.strerror})") from None
    if size > MAX_FILE_BYTES:
        raise ValueError(f"--calibration {path}: {size} bytes, not a calibration file (at most {MAX_FILE_BYTES})")
    try:
        return FamilyCalibration.model_validate(read_json(path))
    except ValidationError as error:
        raise ValueError(f"--calibration {path}: not a tuner calibration file ("
                         f"{' '.join(_first_error(error).split())})") from None
    except ValueError as error:
        raise ValueError(f"--calibration {' '.join(str(error).split())}") from None


def calibration_files(given: tuple[Path, ...]) -> list[Path]:
    """The files ``--calibration`` names: a file as given; a directory's calibration.json, else those of the tuner
    outputs right under it."""
    found: list[Path] = []
    for path in given:
        if not path.is_dir():
            found.append(path)  # a missing one is said by read_calibration, by name
            continue
        inside = [path / CALIBRATION_FILE] if (path / CALIBRATION_FILE).is_file() \
            else sorted(path.glob(f"*/{CALIBRATION_FILE}"))
        if not inside:
            raise ValueError(f"--calibration {path}: no {CALIBRATION_FILE} in it nor in the directories right under it")
        found += inside
    return list(dict.fromkeys(found))


def mismatch(stored: FamilyCalibration, *, family: str, gpu_type: str, key: str) -> str | None:
    """Why a stored refit does not apply to this run, or None."""
    if stored.family != family:
        return f"family {stored.family}, this run's {family}"
    if stored.gpu_type.lower() != gpu_type.lower():
        return f"GPU type {stored.gpu_type}, this run's {gpu_type}"
    if stored.planner_sha256 != key:
        return (f"written under another planner (engine {stored.engine_version}, hardware record "
                f"{stored.planner_sha256[:12]}; this run's {__version__}, {key[:12]})")
    return None


def choose(paths: list[Path], *, family: str, model: str, gpu_type: str, key: str,
           say: Any) -> tuple[Path, FamilyCalibration] | None:
    """The stored refit this run starts from: of the files that apply, the same model's first, then the one of the
    most trials, then the first given. Each file not used is said in one line."""
    usable = []
    for path in paths:
        stored = read_calibration(path)
        why = mismatch(stored, family=family, gpu_type=gpu_type, key=key)
        if why is None:
            usable.append((path, stored))
        else:
            say(f"--calibration {path}: not used: {why}")
    if not usable:
        return None
    best = min(usable, key=lambda u: (u[1].model != model, -u[1].refit.fitted_on, paths.index(u[0])))
    for path, _ in usable:
        if path != best[0]:
            say(f"--calibration {path}: not used: {best[0]} applies too and is chosen (same model first, then more "
                "trials)")
    return best


def starting_calibration(stored: FamilyCalibration, source: Path, *, model: str, compile_prior: float) -> Calibration:
    """The calibration of a run's first prediction from a stored refit of its family: the stored model's own fit
    for the same model, the one-ratio scale for another of the family; the memory offset only for the same model."""
    refit = stored.refit
    speedup = refit.compile_speedup if refit.compile_measured else compile_prior
    if stored.model != model:
        return Calibration(step_scale=refit.one_ratio_step_scale, compile_speedup=speedup,
                           reserve_ratio=refit.reserve_ratio, source=str(source))
    return Calibration(step_scale=refit.step_scale, per_layer_microbatch_s=refit.per_layer_microbatch_s,
                       compile_speedup=speedup, memory_offset_gib=refit.memory_offset_gib,
                       compiled_saving_bytes=refit.compiled_saving_bytes, reserve_ratio=refit.reserve_ratio,
                       source=str(source))


def _prediction(record: dict[str, Any]) -> Prediction:
    raw = record["prediction"]
    return Prediction(**{k: raw[k] for k in Prediction.__dataclass_fields__ if k in raw})


def start_prediction(records: list[dict[str, Any]]) -> StartPrediction | None:
    """The first measured trial measured as the start (phase ``start``), predicted before any of the run's own:
    its prediction against its measurement."""
    start = next((r for r in records if r["phase"] == "start" and r["status"] == "ok" and r.get("prediction")), None)
    if start is None or start["prediction"].get("calibrated_tokens_per_s_per_gpu") is None:
        return None
    prediction, measured = start["prediction"], start["measured"]["tokens_per_s_per_gpu"]
    predicted, planner = prediction["calibrated_tokens_per_s_per_gpu"], prediction["tokens_per_s_per_gpu"]
    return StartPrediction(trial=start["index"], calibration_file=(prediction.get("calibration") or {}).get("source"),
                           planner_tokens_per_s_per_gpu=planner, predicted_tokens_per_s_per_gpu=predicted,
                           measured_tokens_per_s_per_gpu=measured, predicted_error=predicted / measured - 1,
                           planner_error=planner / measured - 1)


def start_text(start: StartPrediction, shown: Callable[[str], str] = str) -> str:
    """The start's prediction against its measurement in one sentence (console, card notes: ``shown`` prints the
    file's path as a card may)."""
    source = (f"calibration {shown(start.calibration_file)}" if start.calibration_file
              else "the planner's engine calibration, no --calibration")
    return (f"trial {start.trial} (the start) predicted {start.predicted_tokens_per_s_per_gpu:,.1f} tokens/s/GPU from "
            f"{source}, measured {start.measured_tokens_per_s_per_gpu:,.1f} ({100 * start.predicted_error:+.1f} %; "
            f"the planner alone {100 * start.planner_error:+.1f} %)")


def _one_ratio_scale(pairs: list[tuple[Prediction, float]], speedup: float) -> float:
    """The geometric mean of the eager-equivalent measured step time over the planner's."""
    logs = [math.log(p.tokens_per_s_per_gpu / measured * (speedup if p.compiled else 1.0)) for p, measured in pairs]
    return math.exp(sum(logs) / len(logs))


def family_calibration(records: list[dict[str, Any]], calibration: Calibration, *, family: str, model: str,
                       gpu_type: str, key: str, compile_inherited: bool = False) -> FamilyCalibration | None:
    """What ``records`` (the run's trials with a prediction) and the refit from them say of the family; None before
    a trial measured anything. ``compile_inherited``: the compile speedup is a stored measurement the run started
    from."""
    measured = [r for r in records if r["status"] == "ok" and r.get("prediction")]
    if not measured or not calibration.fitted_on:
        return None
    pairs = [(_prediction(r), r["measured"]["tokens_per_s_per_gpu"]) for r in measured]
    refit = Refit(step_scale=calibration.step_scale, per_layer_microbatch_s=calibration.per_layer_microbatch_s,
                  one_ratio_step_scale=_one_ratio_scale(pairs, calibration.compile_speedup),
                  compile_speedup=calibration.compile_speedup,
                  compile_measured=compile_inherited or len({p.compiled for p, _ in pairs}) == 2,
                  memory_offset_gib=calibration.memory_offset_gib,
                  compiled_saving_bytes=calibration.compiled_saving_bytes, reserve_ratio=calibration.reserve_ratio,
                  fitted_on=calibration.fitted_on)
    trials = [TrialPrediction(trial=r["index"], label=r["label"], compiled=p.compiled,
                              planner_tokens_per_s_per_gpu=p.tokens_per_s_per_gpu,
                              predicted_tokens_per_s_per_gpu=r["prediction"].get("calibrated_tokens_per_s_per_gpu"),
                              refit_tokens_per_s_per_gpu=calibration.tokens_per_s_per_gpu(p),
                              measured_tokens_per_s_per_gpu=m) for r, (p, m) in zip(measured, pairs)]
    written = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return FamilyCalibration(format=FORMAT, version=VERSION, family=family, model=model, gpu_type=gpu_type,
                             engine_version=__version__, planner_sha256=key, written=written, refit=refit,
                             trials=trials, start=start_prediction(records))


def write_calibration(out: Path, stored: FamilyCalibration) -> Path:
    path = out / CALIBRATION_FILE
    atomic_write_text(path, json.dumps(stored.model_dump(mode="json"), indent=2) + "\n")
    return path


class FamilyMemory:
    """How a ``Search`` starts its calibration and refits it, a mixin reading the search's state (the attributes
    below): from a stored refit of the family when ``--calibration`` gives one that applies, and after every trial
    from the run's own trials, written to ``calibration.json`` for the next run."""

    options: TuneOptions
    out: Path
    planner: Planner
    target: Target
    progress: Progress
    journal: Journal
    tried: dict[str, Candidate]
    calibration: Calibration
    start_model: str
    family: str
    planner_sha256: str
    stored: FamilyCalibration | None  # the refit this run started from
    first_calibration: Calibration  # what the run's first prediction was made under
    start_said: bool
    reserve_s: Callable[[], float]  # the budget's (tune/budget.py)

    def start_calibration(self, model: str) -> Calibration:
        """The calibration of the run's first prediction; says which stored refit it starts from."""
        self.start_model, self.stored, self.start_said = model, None, False
        self.family, self.planner_sha256 = family_name(self.planner), planner_key(self.planner)
        prior = self.planner.compile_prior or 1.0
        chosen = choose(calibration_files(self.options.calibrations), family=self.family, model=model,
                        gpu_type=self.target.gpu_type, key=self.planner_sha256, say=self.progress.say)
        if chosen is None:
            self.first_calibration = Calibration(compile_speedup=prior)
            return self.first_calibration
        path, self.stored = chosen
        same = "this model's" if self.stored.model == model else f"{self.stored.model}'s (the same family)"
        self.progress.say(f"starting from {path}: {same} refit on {self.stored.gpu_type}, "
                          f"{self.stored.refit.fitted_on} trials, family {self.family}")
        self.first_calibration = starting_calibration(self.stored, path, model=model, compile_prior=prior)
        return self.first_calibration

    def compile_prior(self) -> float:
        """The compiled blocks' speedup a refit assumes until this run measured both: a stored measurement's, else
        the planner's prior."""
        if self.stored is not None and self.stored.refit.compile_measured:
            return self.stored.refit.compile_speedup
        return self.planner.compile_prior or 1.0

    def _refit(self) -> None:
        pairs, out_of_memory, reserved = [], [], []
        for record in self.journal.records:
            if not record.get("prediction") or record["key"] not in self.tried:
                continue
            if record["status"] == "ok":
                measured, prediction = record["measured"], _prediction(record)
                pairs.append((prediction, measured["tokens_per_s_per_gpu"], measured.get("peak_memory_gib")))
                if (measured.get("peak_memory_gib") and measured.get("peak_reserved_gib")
                        and not prediction.expandable):
                    reserved.append((prediction.compiled, measured["peak_memory_gib"], measured["peak_reserved_gib"]))
            elif record["failure"]["class"] == "out_of_memory":
                out_of_memory.append(_prediction(record))
        under = [u for r in self.journal.records
                 if r["key"] in self.tried and (u := peak_under_prediction(r)) is not None]
        margin = self.calibration.memory_margin
        fitted = fit_calibration(pairs, out_of_memory=out_of_memory, compile_prior=self.compile_prior(),
                                 reserved=reserved, under_predicted=under)
        if not pairs:  # nothing of its own measured: the calibration it started from, bounded by its out-of-memory
            fitted = dataclasses.replace(self.first_calibration, out_of_memory_gib=fitted.out_of_memory_gib,
                                         memory_margin=fitted.memory_margin)
        self.calibration = fitted
        self.progress.reserve_s = self.reserve_s()
        if self.calibration.memory_margin != margin:
            self.progress.say(f"memory margin now {100 * self.calibration.memory_margin:.3g} % of the device: measured "
                              f"peaks were at most {100 * max(under):+.2g} % of it above their prediction")
        self._remember()

    def _remember(self) -> None:
        """Write the refit for later runs of the family; say the start's prediction against its measurement once."""
        records = [r for r in self.journal.records if r["key"] in self.tried]
        stored = family_calibration(records, self.calibration, family=self.family, model=self.start_model,
                                    gpu_type=self.target.gpu_type, key=self.planner_sha256,
                                    compile_inherited=self.stored is not None and self.stored.refit.compile_measured)
        if stored is None:
            return
        write_calibration(self.out, stored)
        if stored.start is not None and not self.start_said:
            self.start_said = True
            self.progress.say(start_text(stored.start))
