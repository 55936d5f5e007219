"""A stalled rank ends the job after the recipe's heartbeat timeout, named with its last step."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openrecipes.train.heartbeat import Heartbeat

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"


def test_the_clock_runs_only_between_steps(monkeypatch):
    fired = []
    monkeypatch.setattr(Heartbeat, "_end", lambda self, step: (fired.append(step), self._stop.set()))
    beat = Heartbeat(rank=1, timeout_s=0.25, enabled=True)
    beat.step_begins()
    time.sleep(0.6)  # inside a step: waiting for the other ranks in a collective is not a stall
    beat.step_done(0)
    with beat.paused():
        time.sleep(0.6)  # a checkpoint save waits at barriers: not counted either
    beat.step_begins()
    assert fired == []
    beat.step_done(1)
    time.sleep(0.6)  # stuck between steps
    beat.close()
    assert fired == [1]
    assert Heartbeat(rank=0, timeout_s=0.1, enabled=False)._thread is None  # one process: nothing waits for it


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_naming_the_rank_and_step(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "openrecipes", "train", str(EXAMPLE), "--nproc", "2"]
    for item in (f"run_dir={run_dir}", "steps=2", "logging.progress=false", "checkpoint.every=null",
                 "debug.stall_at=[1,0]", "heartbeat_timeout_seconds=2"):
        args += ["--set", item]
    started = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=400,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("openrecipes train: rank 1 failed (exit status 1): StalledRank: rank 1 made no progress for 2 s after "
            "finishing step 0 (heartbeat_timeout_seconds)") in result.stderr, result.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0]
    assert time.monotonic() - started < 300  # not the 10-minute collective timeout
