"""Hostile names and foreign jobs on a real Slurm controller: a recipe, folder, job name or comment holding a
newline, quotes, `$()`, backticks, spaces, `%` or `JobState=COMPLETED ExitCode=0:0` runs as data (no marker file
appears) or is refused in one line before anything is queued; a failed job reads as failed whatever its names hold;
a job under a recorded id that is not the one recorded (another user's, a job id reused after a controller reset) is
neither followed nor cancelled; a job whose id was never recorded is found by its identity.

Skipped without a controller unless OPENRECIPES_REQUIRE_SLURM=1 (tests/slurm_fixtures.py).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from openrecipes.cli import main
from openrecipes.train.slurm import JobIdentity, cancel, current_user, follow, job_identity, job_state, submit
from openrecipes.tune.slurm_runner import JOB_FILE, SlurmJob, SlurmRunner, cancel_jobs

from ..slurm_fixtures import JOB_DEADLINE_S, POLL_S
from ..slurm_fixtures import slurm_cluster  # noqa: F401 (a fixture)

EXAMPLE = "examples/tiny-qwen3-sft.yaml"
HOSTILE = 'w JobState=COMPLETED ExitCode=0:0 $(touch pwned) `touch pwned` "q" \'s\' %j #c'
STATE_TEXT = "x JobState=COMPLETED ExitCode=0:0"


def _all_jobs() -> set[str]:
    return set(subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True, timeout=30,
                              check=True).stdout.split())


def _hostile_recipe(tmp_path):
    folder = tmp_path / HOSTILE
    folder.mkdir()
    recipe = folder / "r $(touch pwned);x %x #.yaml"
    recipe.write_text(Path(EXAMPLE).read_text())
    return folder, recipe


def _launch(recipe, folder, *sets: str) -> list[str]:
    args = ["launch", "slurm", str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--cpu", "--cpus-per-task", "1",
            "--submit", "--poll-seconds", str(POLL_S), "--wait-minutes", "5", "--out", str(folder / "a b.sbatch"),
            "--set", "steps=2", "--set", f"run_dir={folder.parent / 'run'}"]  # a --set value is YAML: " #" ends it
    for item in sets:
        args += ["--set", item]
    return args


def _submitted(out: str) -> str:
    return out.split("submitted job ")[1].split()[0]


@pytest.mark.slow  # a training job
def test_a_hostile_recipe_name_and_folder_run_as_data(slurm_cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder, recipe = _hostile_recipe(tmp_path)
    monkeypatch.chdir(folder)  # the job's working directory is the hostile folder too
    assert main(_launch(recipe, folder)) == 0
    out = capsys.readouterr().out
    job_id = _submitted(out)
    identity = job_identity(job_id)
    assert identity.script == str((folder / "a b.sbatch").resolve()) and identity.user == current_user()
    output = folder / f"{identity.name}-{job_id}.out"  # % kept as written, the job's output where it was promised
    assert f"job {job_id} COMPLETED; output: {output}" in out and output.is_file()
    assert (folder.parent / "run" / "metrics.jsonl").is_file()
    assert not list(tmp_path.rglob("pwned"))


@pytest.mark.slow  # a training job
def test_a_failed_job_in_a_hostile_folder_reads_failed(slurm_cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder, recipe = _hostile_recipe(tmp_path)
    monkeypatch.chdir(folder)
    assert main(_launch(recipe, folder, "debug.fail_at=[0, 0]")) == 1  # rank 0 raises at step 0, on the node
    captured = capsys.readouterr()
    job_id = _submitted(captured.out)
    state = job_state(job_id)
    assert (state.state, state.exit_code) == ("FAILED", 1), state
    assert f"job {job_id} FAILED (exit code 1)" in captured.out and "debug.fail_at" in captured.err
    assert not list(tmp_path.rglob("pwned"))


def test_a_failed_job_reads_failed_whatever_its_name_comment_and_folder_hold(slurm_cluster, tmp_path,
                                                                              monkeypatch):
    folder = tmp_path / HOSTILE
    folder.mkdir()
    script = folder / "fail.sh"
    script.write_text("#!/bin/bash\nexit 3\n")
    monkeypatch.chdir(folder)  # the job's WorkDir
    job_id = submit(script, ("--job-name", STATE_TEXT, "--comment", STATE_TEXT, "--output", "/dev/null"))
    state = follow(job_id, poll_s=POLL_S, deadline_s=JOB_DEADLINE_S)
    assert (state.state, state.exit_code, state.completed) == ("FAILED", 3, False)
    assert job_identity(job_id).name == STATE_TEXT


@pytest.mark.parametrize("flag, value", [("--partition", "ci\ntouch pwned"), ("--account", "a\rtouch pwned"),
                                         ("--time", "10\ntouch pwned"), ("--set", "run_dir=r\ntouch pwned"),
                                         ("--partition", "ci;touch pwned"), ("--time", "$(touch pwned)")])
def test_a_value_that_could_become_code_is_refused_before_anything_is_queued(slurm_cluster, tmp_path, monkeypatch,
                                                                              capsys, flag, value):
    monkeypatch.chdir(tmp_path)
    before = _all_jobs()
    args = ["launch", "slurm", str(Path(EXAMPLE).resolve()), "--nodes", "1",
            "--gpus-per-node", "1", "--cpu", "--submit", flag, value]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag}: " in err[0], err
    assert _all_jobs() == before and not list(tmp_path.rglob("*.sbatch")) and not list(tmp_path.rglob("pwned"))


@pytest.mark.parametrize("extra, flag", [(["--slurm-partition", "ci\ntouch pwned"], "--slurm-partition"),
                                         (["--slurm-account", "$(touch pwned)"], "--slurm-account")])
def test_the_tuner_refuses_such_values_too(slurm_cluster, tmp_path, capsys, extra, flag):
    before = _all_jobs()
    args = ["tune", EXAMPLE, "--gpus", "cpu", "--slurm", "1", "--slurm-cpu", "--trials", "1",
            "--out", str(tmp_path / "out"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag}: " in err[0], err
    assert _all_jobs() == before and not (tmp_path / "out").exists()
    newline_out = tmp_path / "o\ntouch pwned"
    assert main([*args[:-len(extra) - 2], "--out", str(newline_out)]) == 2
    assert "--out: " in capsys.readouterr().err and not newline_out.exists()
    assert not list(tmp_path.rglob("pwned"))


def _sleeper(tmp_path, name: str) -> str:
    """A job of this user that is none of the tool's: what a colleague's or one's own other job looks like."""
    script = tmp_path / f"{name}.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    return submit(script, ("--job-name", name, "--output", "/dev/null"))


def _trial_dir(tmp_path, record: dict):
    trial_dir = tmp_path / "trials" / "000-start"
    trial_dir.mkdir(parents=True)
    (trial_dir / JOB_FILE).write_text(json.dumps(record) + "\n")
    return trial_dir


@pytest.mark.parametrize("recorded", ["old record", "other name", "other script", "other user"])
def test_a_foreign_job_under_a_recorded_id_is_neither_followed_nor_cancelled(slurm_cluster, tmp_path, capsys,
                                                                              recorded):
    foreign = _sleeper(tmp_path, "colleague")
    try:
        shown = job_identity(foreign)
        identity = {"old record": None,
                    "other name": JobIdentity(name="openrecipes-start-0123abcd", user=shown.user, script=shown.script),
                    "other script": JobIdentity(name=shown.name, user=shown.user, script=str(tmp_path / "t.sbatch")),
                    "other user": JobIdentity(name=shown.name, user=shown.user + "x", script=shown.script)}[recorded]
        record = {"job_id": foreign, "submitted": time.time(), **(identity.record() if identity else {})}
        trial_dir = _trial_dir(tmp_path, record)
        runner = SlurmRunner(gpus_per_node=1, cpu=True, cpus_per_task=1, poll_s=POLL_S)
        assert runner.resumable(trial_dir) is None
        if identity is not None:
            assert "is not the job recorded in slurm-job.json" in capsys.readouterr().err
            assert cancel(foreign, identity) is False
            cancel_jobs([SlurmJob(trial=None, job_id=foreign, identity=identity, submitted=time.time())])
        time.sleep(1)
        assert not job_state(foreign).final  # still queued or running: nothing cancelled it
    finally:
        _clean_up(foreign)


def test_a_job_whose_id_was_not_recorded_is_found_by_its_identity(slurm_cluster, tmp_path):
    script = tmp_path / "trial.sbatch"
    script.write_text("#!/bin/bash\nsleep 300\n")
    identity = JobIdentity(name="openrecipes-start-4567cdef", user=current_user(), script=str(script.resolve()))
    job_id = submit(script, ("--output", "/dev/null"), identity)
    try:
        # the tuner stopped after sbatch queued the job but before it wrote the id down
        trial_dir = _trial_dir(tmp_path, {"job_id": None, "submitted": time.time(), **identity.record()})
        runner = SlurmRunner(gpus_per_node=1, cpu=True, cpus_per_task=1, poll_s=POLL_S)
        assert runner.resumable(trial_dir) == trial_dir
        assert job_identity(job_id) == identity and cancel(job_id, identity) is True
        assert follow(job_id, poll_s=POLL_S, deadline_s=60).state == "CANCELLED"
    finally:
        _clean_up(job_id)


def _clean_up(job_id: str) -> None:
    """This test's own job, cancelled whatever it came to (scancel of an ended job only complains)."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def test_without_a_controller_launch_says_so_and_writes_nothing(slurm_cluster, tmp_path, monkeypatch, capsys):
    from ..slurm_fixtures import silence_the_controller

    silence_the_controller(tmp_path, monkeypatch)
    args = ["launch", "slurm", str(Path(EXAMPLE).resolve()), "--nodes", "1", "--gpus-per-node", "1", "--cpu",
            "--submit"]
    monkeypatch.chdir(tmp_path)
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("openrecipes launch: error: no Slurm controller is reachable"), err
    assert not list(tmp_path.glob("*.sbatch"))
