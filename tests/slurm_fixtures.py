"""A Slurm controller for the tests that submit real jobs: skipped without `sbatch` or a controller that answers,
unless OPENRECIPES_REQUIRE_SLURM=1 (CI sets it and runs the tests inside the two-node cluster of
.ci/slurm-cluster.sh), in which case they fail. What a test needs beyond a controller (preemptible partitions,
memory limits) is read from the cluster's own configuration."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest

POLL_S = 0.2  # the tests' look at a job's state (the CLI's default is 5 s)
JOB_DEADLINE_S = 240


def _missing_controller() -> str | None:
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH"
    try:
        answer = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "no reachable Slurm controller (sinfo did not answer within 20 s)"
    if answer.returncode != 0:
        why = next(iter(answer.stderr.strip().splitlines()), f"exit status {answer.returncode}")
        return f"no reachable Slurm controller ({why})"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    problem = _missing_controller()
    if problem:
        if os.environ.get("OPENRECIPES_REQUIRE_SLURM") == "1":
            pytest.fail(problem + " (OPENRECIPES_REQUIRE_SLURM=1)")
        pytest.skip(problem)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_config(key: str) -> str:
    """A setting as the controller reports it (``scontrol show config``), "" when it reports none."""
    shown = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30, check=True)
    for line in shown.stdout.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == key:
            return value.strip()
    return ""


def require_memory_limits() -> None:
    """Skip unless the cluster kills a job over its --mem (task/cgroup): without cgroups it never does."""
    if "task/cgroup" not in slurm_config("TaskPlugin"):
        pytest.skip("the cluster enforces no memory limit (no task/cgroup; .ci/slurm-cluster.sh enables it only "
                    "where it can create a memory cgroup)")


def memory_hog(megabytes: int) -> str:
    """A job script's line that holds ``megabytes`` of touched memory for a few seconds."""
    return f"python3 -c 'import time; held = bytearray({megabytes} * 2**20); time.sleep(5)'"


def scancel(job_id: str) -> None:
    """What a user's own ``scancel ID`` does (the tool itself never cancels on an id alone)."""
    subprocess.run(["scancel", job_id], check=True, timeout=30)


def require_two_nodes() -> None:
    """Skip (fail under OPENRECIPES_REQUIRE_SLURM=1) unless the default partition has the two nodes of
    .ci/slurm-cluster.sh."""
    listed = subprocess.run(["sinfo", "-h", "-N", "-p", "ci", "-o", "%N"], capture_output=True, text=True, timeout=30,
                            check=True).stdout.split()
    if not {"ci1", "ci2"} <= set(listed):
        message = f"needs the two nodes ci1 and ci2 of .ci/slurm-cluster.sh (partition ci has {sorted(set(listed))})"
        if os.environ.get("OPENRECIPES_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)


def job_nodes(job_id: str) -> tuple[str, str]:
    """(how many nodes, which) the job ran on, as squeue lists them."""
    shown = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%D|%N"], capture_output=True,
                           text=True, timeout=30, check=True).stdout.strip()
    count, _, nodes = shown.partition("|")
    return count, nodes


def silence_the_controller(tmp_path, monkeypatch) -> None:
    """Point SLURM_CONF at the same cluster with its controller at a port nothing listens on (skipped without the
    cluster's own SLURM_CONF, .ci/slurm-cluster.sh)."""
    import re
    from pathlib import Path

    conf = Path(os.environ["SLURM_CONF"]).read_text() if "SLURM_CONF" in os.environ else ""
    if "SlurmctldPort=" not in conf:
        pytest.skip("needs the cluster's own SLURM_CONF (.ci/slurm-cluster.sh)")
    silent = tmp_path / "silent.conf"
    silent.write_text(re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={free_port()}", conf) + "MessageTimeout=1\n")
    monkeypatch.setenv("SLURM_CONF", str(silent))
