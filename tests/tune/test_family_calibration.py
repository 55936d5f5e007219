"""The refit a tuning leaves in calibration.json and a later tuning of the same family starts from: written and read
back equal, a second run's start predicted within 10 % where the planner alone is off by more, files of another
family or GPU left out with a note, malformed files refused in one line naming the file and the field.

The runner measures what the planner predicts with a bias of the family's own (a scale and a cost per layer and
microbatch the planner does not model), as a real family's engine differs from the shared engine calibration."""

from __future__ import annotations

import io
import json
import math
import zlib
from pathlib import Path

import pytest

from openrecipes.config.recipe import load_recipe
from openrecipes.tune.family_calibration import FamilyCalibration, choose, read_calibration, write_calibration
from openrecipes.tune.journal import CALIBRATION_FILE
from openrecipes.tune.predict import Planner, Target
from openrecipes.tune.progress import Progress
from openrecipes.tune.search import Search, TuneOptions

from .conftest import SyntheticRunner, write_start

PLANNER_SHARE = 0.85  # the family's engine reaches this share of the planner's step rate ...
PER_LAYER_MICROBATCH_S = 0.007  # ... and spends this long per layer and microbatch on top (a fifth of the start's)
NOISE = 0.03  # and each recipe differs from that by up to this share, as measurements do


def _biased_runner(start: Path) -> SyntheticRunner:
    """A runner whose measured tokens/s/GPU is the planner's with the family's bias (4 rows of 256 tokens per GPU
    per step, as the fixture's metrics count them)."""
    planner = Planner(load_recipe(start), Target(count=2, gpu_type="cpu"), 256)

    def step_time(recipe) -> float:
        p = planner.predict(recipe)
        noise = 1 + NOISE * math.sin(zlib.crc32(recipe.layout.label().encode() + recipe.recompute.granularity.encode()))
        return 1024 / p.tokens_per_s_per_gpu / p.step_time_s * noise * (
            p.step_time_s / PLANNER_SHARE + PER_LAYER_MICROBATCH_S * p.layer_microbatches)

    return SyntheticRunner(step_time=step_time)


def _search(start: Path, out: Path, *, trials: int, calibrations: tuple[Path, ...] = ()) -> tuple[Search, io.StringIO]:
    stream = io.StringIO()
    options = TuneOptions(start=start, out=out, gpus="cpu", trials=trials, minutes=600, trial_steps=8,
                          calibrations=calibrations)
    return Search(options, _biased_runner(start), Progress(trials=trials, minutes=600, stream=stream)), stream


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, rows_dir) -> Path:
    """A tuning of qwen3-moe-tiny on CPU processes: its output directory."""
    folder = tmp_path_factory.mktemp("first")
    start = write_start(folder / "start.yaml", rows_dir)
    search, _ = _search(start, folder / "out", trials=5)
    search.run()
    return folder / "out"


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]


def test_the_refit_is_written_and_read_back_equal(first_run, tmp_path):
    stored = read_calibration(first_run / CALIBRATION_FILE)
    assert (stored.family, stored.model, stored.gpu_type) == ("qwen3_moe", "qwen3-moe-tiny", "cpu")
    measured = [r for r in _records(first_run) if r["status"] == "ok"]
    assert stored.refit.fitted_on == len(measured) == len(stored.trials)
    assert write_calibration(tmp_path, stored) == tmp_path / CALIBRATION_FILE
    assert read_calibration(tmp_path / CALIBRATION_FILE) == stored
    # the per-trial record shows what the refit did: the planner off by the family's bias, the refit close
    for trial in stored.trials:
        assert trial.planner_tokens_per_s_per_gpu / trial.measured_tokens_per_s_per_gpu - 1 > 0.15
        assert abs(trial.refit_tokens_per_s_per_gpu / trial.measured_tokens_per_s_per_gpu - 1) <= NOISE * 1.5
    assert stored.start is not None and stored.start.calibration_file is None and stored.start.planner_error > 0.15


def test_a_second_run_of_the_family_starts_within_ten_percent(first_run, tmp_path, rows_dir):
    # another start of the same model: two rows per microbatch and selective recompute, a trial the first never ran
    start = write_start(tmp_path / "start.yaml", rows_dir, layout={"dp": 2, "ep": 1, "max_tokens_per_gpu": 512},
                        recompute={"granularity": "selective"})
    search, stream = _search(start, tmp_path / "out", trials=1, calibrations=(first_run.parent,))
    search.run()
    first = _records(tmp_path / "out")[0]
    prediction = first["prediction"]
    predicted, planner = prediction["calibrated_tokens_per_s_per_gpu"], prediction["tokens_per_s_per_gpu"]
    measured = first["measured"]["tokens_per_s_per_gpu"]
    assert first["prediction"]["calibration"]["source"] == str(first_run / CALIBRATION_FILE)
    assert abs(predicted / measured - 1) < 0.10 < planner / measured - 1
    stored = read_calibration(tmp_path / "out" / CALIBRATION_FILE)
    assert stored.start.calibration_file == str(first_run / CALIBRATION_FILE)
    assert stored.start.predicted_error == pytest.approx(predicted / measured - 1)
    said = stream.getvalue()
    assert f"starting from {first_run / CALIBRATION_FILE}: this model's refit on cpu" in said
    assert f"predicted {predicted:,.1f} tokens/s/GPU from calibration {first_run / CALIBRATION_FILE}" in said


def test_a_file_of_another_family_or_gpu_is_left_out_with_a_note(first_run, tmp_path, start_yaml):
    stored = read_calibration(first_run / CALIBRATION_FILE)
    other_family = write_calibration(tmp_path / "a", _copy(stored, family="muse_spark"))
    other_gpu = write_calibration(tmp_path / "b", _copy(stored, gpu_type="H200"))
    search, stream = _search(start_yaml, tmp_path / "out", trials=1, calibrations=(other_family, other_gpu))
    assert search.calibration.source is None and search.calibration.step_scale == 1.0
    lines = stream.getvalue().splitlines()
    assert f"[tune] --calibration {other_family}: not used: family muse_spark, this run's qwen3_moe" in lines
    assert f"[tune] --calibration {other_gpu}: not used: GPU type H200, this run's cpu" in lines


def test_of_two_files_that_apply_the_same_model_is_chosen(first_run, tmp_path):
    stored = read_calibration(first_run / CALIBRATION_FILE)
    other_model = write_calibration(tmp_path / "a", _copy(stored, model="qwen3-30b-a3b"))
    same = first_run / CALIBRATION_FILE
    said: list[str] = []
    path, chosen = choose([other_model, same], family="qwen3_moe", model="qwen3-moe-tiny", gpu_type="cpu",
                          key=stored.planner_sha256, say=said.append)
    assert path == same and chosen == stored
    assert said == [f"--calibration {other_model}: not used: {same} applies too and is chosen (same model first, "
                    "then more trials)"]
    said.clear()
    assert choose([same], family="qwen3_moe", model="qwen3-moe-tiny", gpu_type="cpu", key="0" * 64,
                  say=said.append) is None
    assert said and "not used: written under another planner" in said[0]


@pytest.mark.parametrize("edit, field", [
    (lambda tree: tree["refit"].update(step_scale=-1.0), "refit.step_scale"),
    (lambda tree: tree["refit"].update(per_layer_microbatch_s=float("nan")), "refit.per_layer_microbatch_s"),
    (lambda tree: tree.update(version=99), "version"),
    (lambda tree: tree.update(__reduce__="os.system"), "__reduce__"),
    (lambda tree: tree["trials"][0].update(measured_tokens_per_s_per_gpu="fast"),
     "trials.0.measured_tokens_per_s_per_gpu"),
])
def test_a_malformed_file_is_refused_naming_it_and_the_field(first_run, tmp_path, start_yaml, edit, field):
    tree = json.loads((first_run / CALIBRATION_FILE).read_text())
    edit(tree)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(tree))
    with pytest.raises(ValueError) as error:
        _search(start_yaml, tmp_path / "out", trials=1, calibrations=(path,))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"--calibration {path}: ") and field in message


def test_a_file_that_is_not_json_is_refused_in_one_line(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_bytes(b"\x80\x04\x95pickle\n{")
    with pytest.raises(ValueError) as error:
        read_calibration(path)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"--calibration {path}: not valid JSON")


def _copy(stored: FamilyCalibration, **changes) -> FamilyCalibration:
    return stored.model_copy(update=changes)


def test_tune_json_and_the_card_say_where_the_start_prediction_came_from(first_run, tmp_path, start_yaml, monkeypatch,
                                                                      capsys):
    from openrecipes.cards.validate import validate_file
    from openrecipes.cli import main

    monkeypatch.setattr("openrecipes.tune.runner.LocalRunner", lambda **options: _biased_runner(start_yaml))
    out = tmp_path / "out"
    code = main(["tune", str(start_yaml), "--gpus", "cpu", "--trials", "3", "--trial-steps", "8", "--remeasure", "0",
                 "--out", str(out), "--calibration", str(first_run / CALIBRATION_FILE)])
    assert code == 0, capsys.readouterr().err
    start = json.loads((out / "tune.json").read_text())["result"]["start_prediction"]
    assert start["calibration_file"] == str(first_run / CALIBRATION_FILE) and abs(start["predicted_error"]) < 0.10
    assert start["planner_error"] > 0.10
    cards = list((out / "recipes").rglob("*-tuned.yaml"))
    loaded, problems = validate_file(cards[0])
    assert loaded is not None and not [p for p in problems if p.severity == "error"], problems
    # the card holds no machine path: the file by its last part when it lies outside the working directory
    assert (f"Before any trial of its own, trial 0 (the start) predicted "
            f"{start['predicted_tokens_per_s_per_gpu']:,.1f} tokens/s/GPU from calibration {CALIBRATION_FILE}, "
            f"measured {start['measured_tokens_per_s_per_gpu']:,.1f} ({100 * start['predicted_error']:+.1f} %;"
            in loaded.card.notes)
