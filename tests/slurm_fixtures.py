"""A Slurm controller for the tests that submit real jobs: skipped without `sbatch` or a controller that answers,
unless OPENRECIPES_REQUIRE_SLURM=1 (CI sets it and runs the tests inside the one-node cluster of
.ci/slurm-cluster.sh), in which case they fail."""

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
