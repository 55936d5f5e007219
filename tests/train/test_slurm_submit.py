"""`openrecipes launch slurm --submit` against a real Slurm controller: jobs' final states as Slurm reports them
(OUT_OF_MEMORY where the cluster enforces --mem),
the tiny recipe on two CPU workers inside an allocation (the same losses as `train --nproc 2`), a job cancelled by
`scancel` and one cancelled by Ctrl-C.

Skipped without a controller unless OPENRECIPES_REQUIRE_SLURM=1 (tests/slurm_fixtures.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from openrecipes.cli import main
from openrecipes.config.recipe import dump_recipe
from openrecipes.train.slurm import exit_status, follow, job_state, submit

from ..slurm_fixtures import (JOB_DEADLINE_S, POLL_S, free_port, memory_hog, require_memory_limits, scancel,
                              silence_the_controller)
from ..slurm_fixtures import slurm_cluster  # noqa: F401 (a fixture)


@pytest.fixture()
def job_env(monkeypatch):
    """sbatch passes this environment to the job: one torch thread per worker."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _script(tmp_path, name: str, body: str):
    path = tmp_path / f"{name}.sh"
    path.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/{name}-%j.out\n#SBATCH --ntasks=1\n{body}\n")
    return path


def test_final_states_and_exit_codes_as_slurm_reports_them(slurm_cluster, tmp_path):
    done = follow(submit(_script(tmp_path, "ok", "echo fine")), poll_s=POLL_S, deadline_s=JOB_DEADLINE_S)
    failed = follow(submit(_script(tmp_path, "three", "exit 3")), poll_s=POLL_S, deadline_s=JOB_DEADLINE_S)
    assert (done.state, done.describe(), exit_status(done)) == ("COMPLETED", "COMPLETED", 0)
    assert (tmp_path / f"ok-{done.job_id}.out").read_text() == "fine\n"
    assert (failed.state, failed.describe(), exit_status(failed)) == ("FAILED", "FAILED (exit code 3)", 3)
    assert job_state("999999") is None


def test_a_job_over_its_memory_ends_out_of_memory(slurm_cluster, tmp_path):
    require_memory_limits()
    hog = follow(submit(_script(tmp_path, "hog", memory_hog(400)), ("--mem", "100M")), poll_s=POLL_S,
                 deadline_s=JOB_DEADLINE_S)
    assert (hog.state, hog.describe(), exit_status(hog)) == ("OUT_OF_MEMORY", "OUT_OF_MEMORY", 1)
    assert "oom-kill" in (tmp_path / f"hog-{hog.job_id}.out").read_text()


def _recipe_file(make_recipe, tmp_path, name: str, steps: int):
    path = tmp_path / f"{name}.yaml"
    # two workers: data parallel over both, on Slurm as under `train --nproc 2`
    path.write_text(dump_recipe(make_recipe(steps=steps, layout__dp=2, run_dir=str(tmp_path / f"{name}-run"))))
    return path


def _submit_args(recipe, tmp_path, *extra: str) -> list[str]:
    return ["launch", "slurm", str(recipe), "--nodes", "1", "--gpus-per-node", "2", "--cpu", "--cpus-per-task", "2",
            "--port", str(free_port()), "--submit", "--poll-seconds", str(POLL_S), "--wait-minutes", "5",
            "--out", str(tmp_path / f"{recipe.stem}.sbatch"), *extra]


def _losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


@pytest.mark.slow  # torchrun's workers, as tests/distributed
def test_two_workers_in_an_allocation_train_as_train_nproc_2(slurm_cluster, job_env, make_recipe, tmp_path, capsys):
    recipe = _recipe_file(make_recipe, tmp_path, "tiny", steps=4)
    assert main(_submit_args(recipe, tmp_path, "--set", f"run_dir={tmp_path / 'slurm-run'}")) == 0
    out = capsys.readouterr().out
    assert "submitted job " in out and " COMPLETED; output: " in out
    assert main(["train", str(recipe), "--nproc", "2", "--set", f"run_dir={tmp_path / 'local-run'}"]) == 0
    on_slurm, local = _losses(tmp_path / "slurm-run"), _losses(tmp_path / "local-run")
    assert len(on_slurm) == len(local) == 4
    assert on_slurm == pytest.approx(local, abs=1e-6, rel=0)


def _start_following(recipe, tmp_path):
    """The CLI in its own process (so that it can get a SIGINT), and the id of the job it submitted."""
    follower = subprocess.Popen([sys.executable, "-m", "openrecipes", *_submit_args(recipe, tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in follower.stdout:
        if line.startswith("submitted job "):
            return follower, line.split()[2]
    raise AssertionError(f"no job submitted: {follower.stderr.read()}")


def _wait_running(job_id: str) -> None:
    deadline = time.monotonic() + JOB_DEADLINE_S
    while job_state(job_id).state != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} did not start"
        time.sleep(POLL_S)


@pytest.mark.slow  # torchrun's workers, as tests/distributed
def test_a_job_cancelled_with_scancel_is_reported_as_cancelled(slurm_cluster, job_env, make_recipe, tmp_path):
    follower, job_id = _start_following(_recipe_file(make_recipe, tmp_path, "long", steps=100000), tmp_path)
    try:
        _wait_running(job_id)
        scancel(job_id)
        out, err = follower.communicate(timeout=JOB_DEADLINE_S)
    finally:
        follower.kill()
    assert follower.returncode == 1, err
    assert f"job {job_id} CANCELLED" in out and "crash" not in (out + err).lower()


@pytest.mark.slow  # torchrun's workers, as tests/distributed
def test_ctrl_c_cancels_the_job_it_submitted(slurm_cluster, job_env, make_recipe, tmp_path):
    follower, job_id = _start_following(_recipe_file(make_recipe, tmp_path, "stopped", steps=100000), tmp_path)
    try:
        _wait_running(job_id)
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=JOB_DEADLINE_S)
    finally:
        follower.kill()
    assert follower.returncode == 130, err
    assert f"interrupted: scancel {job_id}" in err and f"job {job_id} CANCELLED" in out
    assert job_state(job_id).state == "CANCELLED"


def test_a_controller_that_stops_answering_ends_the_following(slurm_cluster, tmp_path, monkeypatch):
    from openrecipes.train.slurm import SlurmError

    silence_the_controller(tmp_path, monkeypatch)
    started = time.monotonic()
    with pytest.raises(SlurmError, match=r"no Slurm controller is reachable \(squeue -j 1: "):
        follow("1", poll_s=POLL_S, deadline_s=JOB_DEADLINE_S, unreachable_s=0.5)
    assert time.monotonic() - started < 60
