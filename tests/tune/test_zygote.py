"""One-process trials forked from the warm process (tune/zygote.py): measured, classified, stopped at their limit,
and ended with a killed tuner, as trials started as new processes are."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from openrecipes.tune.runner import LocalRunner, TrialRun

from .conftest import write_start
from .test_journal_trust import _gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and PR_SET_PDEATHSIG: Linux")


def _trial(tmp_path, rows_dir, name: str, *, steps: int, timeout_s: float = 120.0, **changes) -> TrialRun:
    trial_dir = tmp_path / name
    trial_dir.mkdir()
    recipe = write_start(trial_dir / "recipe.yaml", rows_dir, steps=steps, run_dir=str(trial_dir / "run"),
                         layout={"max_tokens_per_gpu": 256}, global_batch=2, recompute={"granularity": "none"},
                         **changes)
    return TrialRun(recipe_path=recipe, run_dir=trial_dir / "run", nproc=1, timeout_s=timeout_s,
                    window=(1, steps - 1))


@pytest.fixture
def runner():
    runner = LocalRunner(poll_s=0.1, env={"OMP_NUM_THREADS": "1"})
    yield runner
    if runner._zygote is not None:
        runner._zygote.close()


def test_a_forked_trial_is_measured_and_a_crash_is_classified(tmp_path, rows_dir, runner):
    measured = runner.run(_trial(tmp_path, rows_dir, "ok", steps=3))
    assert runner._zygote is not None and runner._zygote.process.poll() is None  # forked, and the zygote stays
    assert measured.ok, measured.detail
    assert measured.measured["window"] == (1, 2) and measured.measured["tokens_per_s_per_gpu"] > 0
    crashed = runner.run(_trial(tmp_path, rows_dir, "crash", steps=3, debug={"fail_at": [0, 1]}))
    assert crashed.failure == "crash" and "injected failure" in crashed.detail, crashed.detail
    # a second trial from the same warm process
    again = runner.run(_trial(tmp_path, rows_dir, "again", steps=3))
    assert again.ok and again.measured["final_loss"] == measured.measured["final_loss"]


def test_a_forked_trial_is_stopped_at_its_limit(tmp_path, rows_dir, runner):
    trial = _trial(tmp_path, rows_dir, "long", steps=100000, timeout_s=8.0)
    outcome = runner.run(trial)
    assert outcome.failure == "timeout"
    assert not runner._zygote.exited  # the zygote reaped it and the runner took its exit status


def test_a_forked_trial_ends_with_a_killed_tuner(tmp_path, rows_dir):
    trial = _trial(tmp_path, rows_dir, "orphan", steps=100000)
    # a stand-in for the tuner: forks the trial from its zygote, then is SIGKILLed
    tuner = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from openrecipes.tune.zygote import Zygote\n"
        "zygote = Zygote()\n"
        f"child = zygote.fork(['train', {str(trial.recipe_path)!r}, '--exit-with-parent', str(zygote.pid)],\n"
        f"                    Path({str(tmp_path / 'orphan.log')!r}))\n"
        "print(zygote.pid, child.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    zygote, child = map(int, tuner.stdout.readline().split())
    deadline = time.monotonic() + 90
    while not (trial.run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline and not _gone(child):
        time.sleep(0.2)
    assert not _gone(child), "the trial ended before the tuner was killed"
    os.kill(tuner.pid, signal.SIGKILL)
    tuner.wait()
    deadline = time.monotonic() + 30
    while not (_gone(child) and _gone(zygote)) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in (child, zygote) if not _gone(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "the trial or its zygote outlived the tuner"


def test_a_trial_whose_zygote_dies_is_a_failed_trial(tmp_path, rows_dir, runner):
    trial = _trial(tmp_path, rows_dir, "lost", steps=100000, timeout_s=120.0)
    started = time.monotonic()

    def kill_zygote(elapsed: float) -> None:  # once the trial trains, its zygote is killed
        if (trial.run_dir / "metrics.jsonl").exists() and runner._zygote.process.poll() is None:
            runner._zygote.process.kill()

    outcome = runner.run(trial, tick=kill_zygote)
    assert outcome.failure is not None and outcome.failure != "timeout", outcome
    assert time.monotonic() - started < 100


def test_after_the_zygote_dies_the_next_trials_start_as_new_processes(tmp_path, rows_dir, runner, capsys):
    assert runner.run(_trial(tmp_path, rows_dir, "warm", steps=2)).ok
    runner._zygote.process.kill()
    runner._zygote.process.wait(timeout=30)
    outcome = runner.run(_trial(tmp_path, rows_dir, "cold", steps=2))
    assert outcome.ok, outcome
    assert not runner.warm and runner._zygote is None
    assert "[tune] trials start as new processes: the warm process ended" in capsys.readouterr().err


def test_the_zygote_loads_the_compiler_and_leaves_cuda_to_its_children():
    """Dynamo and Inductor are imported before the fork, with torch's NVML check so that Inductor's question "is CUDA
    available" leaves forks able to initialise CUDA (measured on an H200, bench/compile_preload.py)."""
    code = ("import os, sys, torch; import openrecipes.train.loop; from openrecipes.tune import zygote; "
            "zygote.preload(os.getpid(), inductor=True); "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor.compile_fx') if m in sys.modules), "
            "torch.cuda.is_initialized(), os.environ.get(zygote.NVML_CHECK), zygote.forks_can_use_cuda())")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "['torch._dynamo', 'torch._inductor.compile_fx'] False 1 True"


def test_a_zygote_whose_forks_cannot_use_cuda_starts_again_without_inductor():
    """Where importing Inductor left forks unable to initialise CUDA, the zygote replaces itself (same pid) with one
    that imports Dynamo only, and says so when it is ready."""
    code = ("import os; from openrecipes.tune import zygote; zygote.forks_can_use_cuda = lambda: False; "
            "zygote.serve(os.getppid())")
    zygote = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(zygote.stdout.readline())
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    assert ready == {"ready": zygote.pid, "inductor": False}
