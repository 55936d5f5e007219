"""trials.jsonl is bound to its start and to its runs: edited, foreign, malformed and truncated journals are refused
by name; a trial never outlives its tuner, and a rerun never starts a trial that is still running."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openrecipes.tune.journal import SETTINGS_FILE, TRIALS_FILE, Journal, record_result
from openrecipes.tune.progress import Progress
from openrecipes.tune.search import Search, TuneOptions

from .conftest import SyntheticRunner, write_start


def _search(start: Path, out: Path, trials: int = 3) -> Search:
    options = TuneOptions(start=start, out=out, gpus="cpu", trials=trials, minutes=60, trial_steps=8)
    return Search(options, SyntheticRunner(), Progress(trials=trials, minutes=60, stream=io.StringIO()))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / TRIALS_FILE).read_text().splitlines()]


def _rewrite(out: Path, records: list[dict]) -> None:
    (out / TRIALS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def tuned(start_yaml, tmp_path) -> Path:
    out = tmp_path / "out"
    _search(start_yaml, out).run()
    assert all(r["run_sha256"] and r["measured_under"] for r in _records(out) if r["status"] == "ok")
    return out


def test_an_untouched_journal_is_reused(start_yaml, tuned):
    before = _records(tuned)
    search = _search(start_yaml, tuned)
    search.run()
    assert search.runner.calls == [] and _records(tuned) == before


def test_an_edited_measurement_is_refused(start_yaml, tuned):
    records = _records(tuned)
    records[0]["measured"]["tokens_per_s_per_gpu"] = 1e12
    _rewrite(tuned, records)
    with pytest.raises(ValueError, match=r"trials\.jsonl:1: trial start: measured\.tokens_per_s_per_gpu is 1000000000000\.0 "
                                         r"but its run gives [\d.]+: the record was edited"):
        _search(start_yaml, tuned)


def test_a_changed_run_is_refused(start_yaml, tuned):
    run = tuned / _records(tuned)[1]["run_dir"] / "metrics.jsonl"
    lines = [json.loads(line) for line in run.read_text().splitlines()]
    lines[5]["step_time_s"] /= 10  # a faster step, written into the run after it was measured
    run.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=r"trials\.jsonl:2: .*metrics\.jsonl is missing or changed"):
        _search(start_yaml, tuned)


def test_a_journal_of_another_start_is_refused(start_yaml, tuned, tmp_path, rows_dir):
    from .conftest import SLOW_START

    other = write_start(tmp_path / "other.yaml", rows_dir, optimizer={**SLOW_START["optimizer"], "lr": 3.0e-2})
    out = tmp_path / "copied"
    out.mkdir()
    (out / ".openrecipes-tune").write_text("copied\n")
    shutil.copy(tuned / TRIALS_FILE, out / TRIALS_FILE)
    shutil.copytree(tuned / "trials", out / "trials")
    with pytest.raises(ValueError, match=r"trials\.jsonl:1: trial start was measured for another start"):
        _search(other, out)


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.update(measured=None), "status ok needs measured"),
    (lambda r: r.update(status="maybe"), "status: Input should be 'ok' or 'failed'"),
    (lambda r: r.pop("measured_under"), "measured_under: Field required"),
    (lambda r: r["measured"].update(tokens_per_s_per_gpu="fast"), "measured.tokens_per_s_per_gpu"),
    (lambda r: r.update(failure={"class": "gremlins", "detail": ""}, status="failed", measured=None), "failure.class"),
])
def test_a_malformed_record_is_refused_in_one_line(start_yaml, tuned, edit, message):
    records = _records(tuned)
    edit(records[0])
    _rewrite(tuned, records)
    with pytest.raises(ValueError, match=rf"trials\.jsonl:1: not a trial record .*{message}") as error:
        _search(start_yaml, tuned)
    assert "\n" not in str(error.value)


def test_a_truncated_journal_is_refused(start_yaml, tuned):
    text = (tuned / TRIALS_FILE).read_text()
    (tuned / TRIALS_FILE).write_text(text[: len(text) - 40])
    with pytest.raises(ValueError, match=r"trials\.jsonl:\d+"):
        _search(start_yaml, tuned)


def test_a_trial_still_running_is_not_started_again(start_yaml, tuned):
    import socket

    journal = Journal(tuned, measured_under=_records(tuned)[0]["measured_under"])
    run = journal.trial_dir(9, "abc") / "run"
    run.mkdir(parents=True)
    (run / ".openrecipes-run.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                          "command": "openrecipes train x"}))
    with pytest.raises(ValueError, match=rf"trial abc is still running as process {os.getpid()}"):
        journal.fresh_trial_dir(9, "abc")
    assert run.is_dir()  # nothing deleted


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in state  # a zombie waiting to be reaped has ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_trial_dies_with_a_killed_tuner(tmp_path, rows_dir):
    from openrecipes.tune.runner import LocalRunner, TrialRun

    recipe = write_start(tmp_path / "long.yaml", rows_dir, steps=100000, run_dir=str(tmp_path / "run"),
                         layout={"max_tokens_per_gpu": 256})
    trial = TrialRun(recipe_path=recipe, run_dir=tmp_path / "run", nproc=1, timeout_s=600, window=(1, 2))
    # a stand-in for the tuner: starts the trial as the local runner does (its own session), then is SIGKILLed
    parent = subprocess.Popen([sys.executable, "-c", (
        "import json, os, subprocess, sys, time\n"
        f"command = {LocalRunner().command(trial)!r}[:-1] + [str(os.getpid())]\n"
        "child = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,\n"
        "                         stderr=subprocess.DEVNULL)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 90
    while not (tmp_path / "run" / "metrics.jsonl").exists() and time.monotonic() < deadline and not _gone(child):
        time.sleep(0.2)  # the trial is training (or ended on its own, which the assertion below reports)
    assert not _gone(child), "the trial ended before the tuner was killed"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = not _gone(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the trial outlived the tuner that started it"


def test_a_recorded_result_is_not_a_setting(start_yaml, tuned):
    # tune.json gains the finished search's figures; a rerun compares only the settings, and an edited setting is
    # still refused by name
    record_result(tuned, {"outcome": "tuned", "minutes": 1.5})
    settings = json.loads((tuned / SETTINGS_FILE).read_text())
    assert settings["result"] == {"outcome": "tuned", "minutes": 1.5} and "trial_steps" in settings
    _search(start_yaml, tuned).run()
    (tuned / SETTINGS_FILE).write_text(json.dumps({**settings, "trial_steps": 99}))
    with pytest.raises(ValueError, match="trial_steps differ"):
        _search(start_yaml, tuned).run()
