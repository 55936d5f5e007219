"""One job per run directory; a killed launcher leaves no workers and no lock that blocks the next run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openrecipes.config.rundir import LOCK_FILE
from openrecipes.train.run_lock import run_dir_lock

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"


def test_a_second_job_is_refused_naming_the_holder(tmp_path):
    with run_dir_lock(tmp_path, "openrecipes train first.yaml"):
        with pytest.raises(ValueError, match=rf"in use by process {os.getpid()} \(openrecipes train first.yaml"):
            with run_dir_lock(tmp_path, "openrecipes train second.yaml"):
                pass
    assert not (tmp_path / LOCK_FILE).exists()  # released


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    import socket

    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "command": "x"}))
    with run_dir_lock(tmp_path, "openrecipes train next.yaml"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux")
def test_killing_the_launcher_ends_its_workers(tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "openrecipes", "train", str(EXAMPLE), "--nproc", "2", "--set", f"run_dir={run_dir}",
         "--set", "steps=400", "--set", "logging.progress=false", "--set", "checkpoint.every=null"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(1)
    assert (run_dir / "metrics.jsonl").exists(), "the job never started training"
    workers = {p for child in _children(launcher.pid) for p in _children(child) | {child}}
    assert workers, "no training processes found under the launcher"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 60
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(1)
    assert not any(Path(f"/proc/{p}/stat").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
                   for p in workers)
    # the next job takes the stale lock over
    with run_dir_lock(run_dir, "next"):
        pass
