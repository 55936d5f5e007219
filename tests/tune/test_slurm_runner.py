"""The tuner's Slurm runner against a real controller: a trial submitted as a job and measured, a refused layout
classified from the job's output, a job cancelled by scancel, at the trial's limit and on Ctrl-C, none of them
left running, and jobs that Slurm itself ends: preempted by a higher partition's job, killed for overrunning their
memory. Skipped without a controller unless OPENRECIPES_REQUIRE_SLURM=1 (tests/slurm_fixtures.py)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time

import pytest

from openrecipes.train.slurm import follow, job_identity, job_state, submit
from openrecipes.tune.runner import TRAIN_LOG, TrialRun
from openrecipes.tune.slurm_runner import SlurmJob, SlurmRunner

from ..slurm_fixtures import POLL_S, memory_hog, require_memory_limits, scancel, slurm_config
from ..slurm_fixtures import slurm_cluster  # noqa: F401 (a fixture)
from .conftest import write_start

ONE_WORKER = {"dp": 1, "ep": 1, "max_tokens_per_gpu": 256}


@pytest.fixture()
def runner(monkeypatch) -> SlurmRunner:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # sbatch passes it to the job: one torch thread per worker
    return SlurmRunner(gpus_per_node=1, cpu=True, cpus_per_task=1, poll_s=POLL_S)


def _trial(tmp_path, rows_dir, name: str, *, steps: int, timeout_s: float = 240.0, debug: dict | None = None,
           **layout) -> TrialRun:
    trial_dir = tmp_path / name
    trial_dir.mkdir()
    # the tuner's starting recipe, made cheap: one worker, two rows a step, nothing recomputed
    recipe = write_start(trial_dir / f"{name}.yaml", rows_dir, steps=steps, layout={**ONE_WORKER, **layout},
                         global_batch=2, recompute={"granularity": "none"}, run_dir=str(trial_dir / "run"),
                         **({"debug": debug} if debug else {}))
    return TrialRun(recipe_path=recipe, run_dir=trial_dir / "run", nproc=1, timeout_s=timeout_s,
                    window=(1, steps - 1))


def _job_named(name: str) -> str:
    """The id of the job the runner submitted for the recipe file ``name`` (its job name: the tool's prefix, the
    recipe's name, a random token)."""
    listed = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %j"], capture_output=True, text=True,
                            timeout=30, check=True).stdout.splitlines()
    ids = [line.split()[0] for line in listed if re.fullmatch(rf"\S+ openrecipes-{name}-[0-9a-f]{{8}}", line)]
    assert len(ids) == 1, listed
    return ids[0]


@pytest.mark.slow  # a training job
def test_a_trial_runs_as_a_slurm_job_and_is_measured(slurm_cluster, runner, tmp_path, rows_dir):
    trial = _trial(tmp_path, rows_dir, "measured", steps=4)
    outcome = runner.run(trial)
    assert outcome.ok, (outcome.failure, outcome.detail)
    assert outcome.measured["tokens_per_s_per_gpu"] > 0 and outcome.measured["final_loss"] > 0
    assert (trial.run_dir.parent / TRAIN_LOG).is_file() and "#SBATCH --time=3" in (
        trial.run_dir.parent / "trial.sbatch").read_text()
    assert job_state(_job_named("measured")).state == "COMPLETED"


@pytest.mark.slow  # a training job
def test_a_refused_layout_is_classified_from_the_jobs_output(slurm_cluster, runner, tmp_path, rows_dir):
    outcome = runner.run(_trial(tmp_path, rows_dir, "refused", steps=4, ep=3))
    assert outcome.failure == "refused_layout" and "ep=3 must divide" in outcome.detail
    assert job_state(_job_named("refused")).state == "FAILED"


def _when_running(name: str, action):
    """A tick that does ``action(job_id)`` once the trial's job runs."""
    def tick(elapsed_s: float) -> None:
        state = job_state(_job_named(name))
        if state.state == "RUNNING":
            action(state.job_id)
        assert elapsed_s < 120, f"job {name} did not start"
    return tick


def test_a_job_cancelled_with_scancel_is_a_cancelled_trial(slurm_cluster, runner, tmp_path, rows_dir):
    outcome = runner.run(_trial(tmp_path, rows_dir, "scancelled", steps=100000),
                         tick=_when_running("scancelled", scancel))
    assert outcome.failure == "cancelled" and "CANCELLED" in outcome.detail


def test_the_trial_limit_and_ctrl_c_cancel_the_job(slurm_cluster, runner, tmp_path, rows_dir):
    outcome = runner.run(_trial(tmp_path, rows_dir, "limited", steps=100000, timeout_s=3.0))
    assert outcome.failure == "timeout" and "trial limit of 3 s" in outcome.detail

    def interrupt(job_id: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run(_trial(tmp_path, rows_dir, "interrupted", steps=100000), tick=_when_running("interrupted", interrupt))
    for name in ("limited", "interrupted"):  # cancelled, not left running unwatched
        assert follow(_job_named(name), poll_s=POLL_S, deadline_s=60).state == "CANCELLED"


def _stalled(tmp_path, rows_dir, name: str, timeout_s: float = 240.0) -> TrialRun:
    """A trial whose one worker hangs after its first step (debug.stall_at), as a stuck job would."""
    return _trial(tmp_path, rows_dir, name, steps=4, timeout_s=timeout_s, debug={"stall_at": [0, 0]})


@pytest.mark.slow  # Slurm's shortest time limit is a minute
def test_slurms_own_time_limit_is_a_timeout_trial(slurm_cluster, runner, tmp_path, rows_dir):
    # a 120 s limit asks Slurm for 1 minute: Slurm ends the job (TIMEOUT) before the tuner would cancel it
    trial = _stalled(tmp_path, rows_dir, "overtime", timeout_s=120.0)
    outcome = runner.run(trial)
    assert "#SBATCH --time=1" in (trial.run_dir.parent / "trial.sbatch").read_text()
    assert outcome.failure == "timeout" and "TIMEOUT" in outcome.detail, outcome.detail
    assert 60 <= outcome.wall_s < 120


def _job_node(job_id: str) -> str:
    """The node the job runs on (a one-node job)."""
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def test_a_node_taken_down_under_a_job_is_a_node_fail_trial(slurm_cluster, runner, tmp_path, rows_dir):
    downed: list[str] = []

    def take_down(job_id: str) -> None:
        if not downed:
            downed.append(_job_node(job_id))
            subprocess.run(["scontrol", "update", f"nodename={downed[0]}", "state=down", "reason=test"], check=True,
                           timeout=30)

    try:
        outcome = runner.run(_stalled(tmp_path, rows_dir, "downed"), tick=_when_running("downed", take_down))
    finally:  # the node back for the other tests
        for node in downed:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=30)
            deadline = time.monotonic() + 60
            while "idle" not in _node_state(node) and time.monotonic() < deadline:
                time.sleep(POLL_S)
    assert outcome.failure == "node_fail" and "NODE_FAIL" in outcome.detail, (outcome.failure, outcome.detail)


def _node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True,
                          timeout=30).stdout


def test_tune_refuses_a_node_without_gpus_and_reports_sbatch_errors(slurm_cluster, start_yaml, tmp_path, capsys):
    from openrecipes.cli import main

    with pytest.raises(SystemExit) as refused:  # argparse's refusal of the option's value
        main(["tune", str(start_yaml), "--slurm", "0", "--out", str(tmp_path / "none")])
    assert refused.value.code == 2 and "argument --slurm: 0 is not an integer >= 1" in capsys.readouterr().err
    # a partition the cluster does not have: sbatch refuses the first trial, the tuner ends with its one line
    assert main(["tune", str(start_yaml), "--gpus", "cpu", "--slurm", "2", "--slurm-cpu", "--slurm-partition",
                 "no-such-partition", "--trials", "1", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("openrecipes tune: error: sbatch ") and "invalid partition" in err[-1].lower()


def _whole_node_job(tmp_path, partition: str) -> str:
    """A short job that needs every CPU of the node (--exclusive), whatever SLURM_NODE_CPUS made it."""
    script = tmp_path / "whole-node.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    return submit(script, ("--partition", partition, "--exclusive", "--output", str(tmp_path / "whole-node.out")))


def test_a_job_preempted_by_a_higher_partition_is_a_preempted_trial(slurm_cluster, runner, tmp_path, rows_dir):
    partitions = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30,
                                check=True).stdout.split()
    if not {"ci-low", "ci-high"} <= set(partitions) or slurm_config("PreemptType") != "preempt/partition_prio":
        pytest.skip("needs the preemptible partition ci-low under ci-high (.ci/slurm-cluster.sh)")
    high: list[str] = []

    def preempt(job_id: str) -> None:  # once the trial runs, a ci-high job that needs the whole node, once
        if not high:
            high.append(_whole_node_job(tmp_path, "ci-high"))

    # Slurm cancels the ci-low trial's job to start the ci-high one
    outcome = dataclasses.replace(runner, partition="ci-low").run(
        _trial(tmp_path, rows_dir, "preempted", steps=100000), tick=_when_running("preempted", preempt))
    assert outcome.failure == "preempted" and "PREEMPTED" in outcome.detail, (outcome.failure, outcome.detail)
    assert follow(high[0], poll_s=POLL_S, deadline_s=60).state == "COMPLETED"


def test_a_trial_over_its_memory_is_an_out_of_memory_trial(slurm_cluster, runner, tmp_path, rows_dir, monkeypatch):
    require_memory_limits()
    monkeypatch.setenv("SBATCH_MEM_PER_NODE", "100M")  # sbatch's --mem: less than Python with torch imported takes
    outcome = runner.run(_trial(tmp_path, rows_dir, "overgrown", steps=4))
    # the OOM killer ends srun's step, not the batch script: the script fails (FAILED, exit code 1), and the
    # class comes from srun's line in the job's output
    assert outcome.failure == "out_of_memory" and "Out Of Memory" in outcome.detail, (outcome.failure,
                                                                                      outcome.detail)
    assert job_state(_job_named("overgrown")).state == "FAILED"


def test_a_job_slurm_ends_out_of_memory_is_an_out_of_memory_trial(slurm_cluster, runner, tmp_path, rows_dir):
    require_memory_limits()
    # the batch script itself over its --mem: this is the job Slurm reports OUT_OF_MEMORY
    script = tmp_path / "hog.sh"
    script.write_text(f"#!/bin/bash\n{memory_hog(400)}\n")
    job_id = submit(script, ("--mem", "100M", "--output", str(tmp_path / "hog.out")))
    job = SlurmJob(trial=_trial(tmp_path, rows_dir, "hog", steps=4), job_id=job_id, submitted=time.time(),
                   identity=job_identity(job_id))
    outcome = runner.wait_any([job])[1]
    assert outcome.failure == "out_of_memory" and outcome.detail == f"job {job_id} OUT_OF_MEMORY", outcome.detail
