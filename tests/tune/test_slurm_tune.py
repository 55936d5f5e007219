"""``openrecipes tune --slurm`` as a user runs it, against a real controller: Ctrl-C (SIGINT) cancels the trial's job
(with ``--max-parallel 2``, both running jobs), a rerun after the tuner was killed follows the job it left queued or
running instead of submitting it again, and ``--max-parallel 2`` runs two search trials' jobs at the same time.
Skipped without a controller unless OPENRECIPES_REQUIRE_SLURM=1 (tests/slurm_fixtures.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openrecipes.train.slurm import follow, job_state
from openrecipes.tune.journal import TRIALS_DIR, TRIALS_FILE
from openrecipes.tune.slurm_runner import JOB_FILE

from ..slurm_fixtures import POLL_S, job_nodes, require_two_nodes
from ..slurm_fixtures import slurm_cluster  # noqa: F401 (a fixture)
from .conftest import write_start

START_WAIT_S = 120


@pytest.fixture()
def one_worker_start(tmp_path, rows_dir) -> Path:
    """The slow start on one worker, two rows a step: each trial a short one-process job."""
    return write_start(tmp_path / "start.yaml", rows_dir, layout={"dp": 1, "ep": 1, "max_tokens_per_gpu": 256},
                       global_batch=2)


def _tune_args(start: Path, out: Path, *extra: str) -> list[str]:
    return ["tune", str(start), "--gpus", "cpu", "--slurm", "1", "--slurm-cpu", "--slurm-cpus-per-task", "1",
            "--slurm-poll-seconds", str(POLL_S), "--trial-steps", "3", "--remeasure", "0", "--out", str(out), *extra]


def _tuner(args: list[str], out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # sbatch passes it on to the job
    return subprocess.Popen([sys.executable, "-m", "openrecipes", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _start_job(out: Path, tuner: subprocess.Popen) -> str:
    """The start trial's job id once the job runs (the tuner recorded it in the trial's folder)."""
    job_file = out / TRIALS_DIR / "000-start" / JOB_FILE
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        assert tuner.poll() is None, tuner.communicate()[0]
        job_id = _recorded_id(job_file)
        if job_id is not None and job_state(job_id).state == "RUNNING":
            return job_id
        time.sleep(POLL_S)
    raise AssertionError(f"the start's job did not run within {START_WAIT_S} s")


def _recorded_id(job_file: Path) -> str | None:
    """The job id the tuner recorded for a trial: None before sbatch answered (the file holds the job's identity
    from before submission)."""
    return json.loads(job_file.read_text())["job_id"] if job_file.is_file() else None


def _our_jobs() -> set[str]:
    return set(subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True, timeout=30,
                              check=True).stdout.split())


def test_ctrl_c_cancels_the_trials_job(slurm_cluster, one_worker_start, tmp_path):
    out = tmp_path / "out"
    tuner = _tuner(_tune_args(one_worker_start, out, "--trials", "1"), out)
    job_id = _start_job(out, tuner)
    tuner.send_signal(signal.SIGINT)
    output = tuner.communicate(timeout=60)[0]
    assert tuner.returncode != 0, output
    assert follow(job_id, poll_s=POLL_S, deadline_s=60).state == "CANCELLED"


@pytest.mark.slow  # training jobs
def test_a_rerun_follows_the_job_a_killed_tuner_left_and_reuses_finished_trials(slurm_cluster, one_worker_start,
                                                                               tmp_path):
    from openrecipes.cli import main

    out = tmp_path / "out"
    args = _tune_args(one_worker_start, out, "--trials", "1")
    tuner = _tuner(args, out)
    job_id = _start_job(out, tuner)
    tuner.kill()  # no Ctrl-C handler runs: the job goes on, unwatched
    tuner.wait(timeout=30)
    assert not job_state(job_id).final
    before = _our_jobs()
    assert main(args) == 0  # follows job_id to its end and measures it
    records = [json.loads(line) for line in (out / TRIALS_FILE).read_text().splitlines()]
    assert [(r["key"], r["status"]) for r in records] == [("start", "ok")]
    assert json.loads((out / TRIALS_DIR / "000-start" / JOB_FILE).read_text())["job_id"] == job_id
    assert job_state(job_id).state == "COMPLETED" and _our_jobs() == before  # nothing submitted again
    assert main(args) == 0 and _our_jobs() == before  # a finished trial is reused from trials.jsonl


def _run_span(job_id: str) -> tuple[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30,
                           check=True).stdout
    fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
    return fields["StartTime"], fields["EndTime"]


@pytest.mark.slow  # a whole tuning run
def test_max_parallel_runs_search_trials_side_by_side(slurm_cluster, one_worker_start, tmp_path):
    from openrecipes.cli import main
    from openrecipes.tune.journal import Journal

    out = tmp_path / "out"
    assert main(_tune_args(one_worker_start, out, "--trials", "3", "--max-parallel", "2")) == 0
    searched = sorted(p for p in (out / TRIALS_DIR).iterdir() if p.name[:3] in ("001", "002"))
    assert len(searched) == 2, searched
    (start1, end1), (start2, end2) = (_run_span(json.loads((p / JOB_FILE).read_text())["job_id"]) for p in searched)
    assert start1 < end2 and start2 < end1, (start1, end1, start2, end2)  # ISO times: ordered as strings
    # every trial recorded once, each with its own run: trials.jsonl reads back (its figures recomputed)
    records = [json.loads(line) for line in (out / TRIALS_FILE).read_text().splitlines()]
    journal = Journal(out, measured_under=records[0]["measured_under"])
    assert len({r["key"] for r in journal.records}) == len(journal.records) >= 3


@pytest.mark.slow  # the start trial trains before the two search trials' jobs run
def test_ctrl_c_with_two_trials_running_cancels_both_jobs(slurm_cluster, one_worker_start, tmp_path):
    out = tmp_path / "out"
    # 20 steps a trial (the last --trial-steps counts): the two jobs run long enough to be seen running together
    tuner = _tuner(_tune_args(one_worker_start, out, "--trials", "3", "--max-parallel", "2", "--trial-steps", "20"),
                   out)
    running: dict[str, str] = {}
    deadline = time.monotonic() + 2 * START_WAIT_S
    while len(running) < 2 and time.monotonic() < deadline:
        assert tuner.poll() is None, tuner.communicate()[0]
        for job_file in (out / TRIALS_DIR).glob("00[12]-*/" + JOB_FILE):
            job_id = _recorded_id(job_file)
            if job_id is not None and job_state(job_id).state == "RUNNING":
                running[job_file.parent.name] = job_id
        time.sleep(POLL_S)
    assert len(running) == 2, f"two search trials' jobs did not run at once within {2 * START_WAIT_S} s: {running}"
    tuner.send_signal(signal.SIGINT)
    output = tuner.communicate(timeout=60)[0]
    assert tuner.returncode != 0, output
    for job_id in running.values():
        assert follow(job_id, poll_s=POLL_S, deadline_s=60).state == "CANCELLED", job_id
    queued = set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30,
                                check=True).stdout.split())  # pending, running and completing jobs only
    assert not queued & set(running.values()), queued


@pytest.mark.slow  # the start's trial on two nodes
def test_a_trial_runs_over_two_nodes(slurm_cluster, tmp_path, rows_dir, monkeypatch):
    from openrecipes.cli import main

    require_two_nodes()
    start = write_start(tmp_path / "four.yaml", rows_dir, layout={"dp": 4, "ep": 1, "max_tokens_per_gpu": 256},
                        global_batch=4)
    out = tmp_path / "out"
    args = ["tune", str(start), "--gpus", "cpu", "--slurm", "2", "--slurm-cpu", "--slurm-cpus-per-task", "2",
            "--slurm-poll-seconds", str(POLL_S), "--trial-steps", "3", "--remeasure", "0", "--trials", "1",
            "--out", str(out)]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # sbatch passes it on to the job
    assert main(args) == 0
    records = [json.loads(line) for line in (out / TRIALS_FILE).read_text().splitlines()]
    assert [(r["key"], r["status"]) for r in records] == [("start", "ok")]
    assert job_nodes(_recorded_id(out / TRIALS_DIR / "000-start" / JOB_FILE)) == ("2", "ci[1-2]")
