"""Two nodes of the test cluster (.ci/slurm-cluster.sh starts ci1 and ci2 on this machine, each its own slurmd):
`launch slurm --nodes 2` trains the tiny recipe over four gloo workers, rendezvous on the first node's address, as
one process does; a node lost mid-run (its slurmd and its workers killed) ends the job NODE_FAIL, and `launch slurm
--resume` continues from the last checkpoint to the losses of an unbroken run. (A tuner's trial over two nodes:
tests/tune/test_slurm_tune.py.)

Skipped without a controller of two idle nodes unless OPENRECIPES_REQUIRE_SLURM=1 (tests/slurm_fixtures.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from openrecipes.cli import main
from openrecipes.train.slurm import job_state

from ..distributed.test_layouts import COMMON, EXAMPLE, assert_same, metrics, train_metrics
from ..slurm_fixtures import JOB_DEADLINE_S, POLL_S, free_port, job_nodes, require_two_nodes, slurm_config
from ..slurm_fixtures import slurm_cluster  # noqa: F401 (a fixture)

TWO_NODES = ["--nodes", "2", "--gpus-per-node", "2", "--cpu", "--cpus-per-task", "2"]
SECOND_NODE = "ci2"


@pytest.fixture()
def two_nodes(slurm_cluster, monkeypatch):
    require_two_nodes()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # sbatch passes it to the job: one torch thread per worker


def _launch_args(tmp_path: Path, run_dir: Path, *sets: str, resume: bool = False) -> list[str]:
    what = ["--resume", str(run_dir)] if resume else [str(EXAMPLE), "--set", f"run_dir={run_dir}"]
    args = ["launch", "slurm", *what, *TWO_NODES, "--port", str(free_port()), "--submit", "--poll-seconds",
            str(POLL_S), "--wait-minutes", str(JOB_DEADLINE_S / 60), "--out", str(tmp_path / f"{run_dir.name}.sbatch")]
    for item in ([] if resume else COMMON) + list(sets):
        args += ["--set", item]
    return args


def _final_weights(run_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of the run's last checkpoint (a DCP directory this test's runs wrote)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    dcp_to_torch_save(last, scratch)
    return torch.load(scratch, weights_only=False)["model"]


@pytest.mark.slow  # torchrun's workers on two nodes
def test_four_workers_on_two_nodes_train_as_one_process(two_nodes, tmp_path, capsys):
    run_dir = tmp_path / "two-nodes"
    assert main(_launch_args(tmp_path, run_dir)) == 0
    out = capsys.readouterr().out
    job_id = out.split("submitted job ")[1].split()[0]
    assert job_nodes(job_id) == ("2", "ci[1-2]")
    assert json.loads((run_dir / "run.json").read_text())["world_size"] == 4
    reference = train_metrics(tmp_path / "one", "layout.dp=1")
    assert_same(metrics(run_dir), reference)
    one, two = _final_weights(tmp_path / "one", tmp_path / "one.pt"), _final_weights(run_dir, tmp_path / "two.pt")
    assert one.keys() == two.keys()
    # Adam moves a weight by up to lr (3e-3) a step whatever its gradient's size: where a gradient is near zero, the
    # other summation order of four ranks shows in the last bits of the update (measured at most 2.7e-5 after five
    # steps); a gradient summed or averaged wrongly moves weights by the order of lr
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-4, msg=name)


def _node_processes(job_id: str, node: str) -> list[int]:
    """The job's processes on ``node`` (``scontrol listpids`` of that node's slurmd) and their step daemon."""
    listed = subprocess.run(["scontrol", "listpids", job_id, node], capture_output=True, text=True, timeout=30,
                            check=True).stdout.splitlines()[1:]
    pids = [int(line.split()[0]) for line in listed if line.split()]
    daemons = set()
    for pid in pids:
        parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        if Path(f"/proc/{parent}/comm").read_text().strip() == "slurmstepd":
            daemons.add(int(parent))
    return pids + sorted(daemons)


def _slurmd_pid(node: str) -> int:
    return int(Path(slurm_config("SlurmdPidFile").replace("%n", node)).read_text())


def _lose_node(job_id: str, node: str) -> None:
    """What a node's loss looks like to the cluster: its slurmd, its step daemon and its workers gone at once."""
    for pid in [_slurmd_pid(node), *_node_processes(job_id, node)]:
        os.kill(pid, signal.SIGKILL)


def _restore_node(node: str) -> None:
    conf = os.environ["SLURM_CONF"]
    subprocess.run(["slurmd", "-N", node, "-f", conf], check=True, timeout=60)  # daemonizes; its pid file is read
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=30)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True,
                               timeout=30).stdout.split()
        if state and state[0] == "idle":
            return
        time.sleep(POLL_S)
    raise AssertionError(f"node {node} did not come back")


def _wait_for_step(run_dir: Path, step: int, follower: subprocess.Popen) -> None:
    deadline = time.monotonic() + JOB_DEADLINE_S
    while time.monotonic() < deadline:
        assert follower.poll() is None, follower.communicate()
        if (run_dir / "metrics.jsonl").is_file() and any(
                record.get("step") == step for record in metrics(run_dir)):
            return
        time.sleep(POLL_S)
    raise AssertionError(f"step {step} was not reached")


@pytest.mark.slow  # torchrun's workers on two nodes, twice, and a node that must come back
def test_a_lost_node_ends_the_job_node_fail_and_resume_continues_it(two_nodes, tmp_path):
    run_dir = tmp_path / "lost"
    # rank 2 (the second node's first worker) stops after step 4, the others wait for it in step 5: the node is
    # lost mid-run, after the checkpoint of step 3
    sets = ["steps=8", "checkpoint.every=2", "debug.stall_at=[2, 4]", "heartbeat_timeout_seconds=600"]
    follower = subprocess.Popen([sys.executable, "-m", "openrecipes", *_launch_args(tmp_path, run_dir, *sets)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = follower.stdout.readline()
        while line and not line.startswith("submitted job "):
            line = follower.stdout.readline()
        job_id = line.split()[2]
        _wait_for_step(run_dir, 4, follower)
        _lose_node(job_id, SECOND_NODE)
        out, err = follower.communicate(timeout=JOB_DEADLINE_S)
    finally:
        follower.kill()
        _restore_node(SECOND_NODE)
    assert follower.returncode == 1, (out, err)
    assert job_state(job_id).state == "NODE_FAIL" and f"job {job_id} NODE_FAIL" in out, (out, err)
    assert "Node failure on ci2" in err  # srun's line, in the output's tail
    assert main(_launch_args(tmp_path, run_dir, "debug.stall_at=null", resume=True)) == 0
    reference = train_metrics(tmp_path / "unbroken", "layout.dp=1", "steps=8")
    assert_same(metrics(run_dir), reference)
