"""bench/run.py on the CPU: a workload with a peer, engine and peer each in its own process, one round, the results
file carrying the machine, the settings and every sample (a plumbing check at tiny widths)."""

import os
import subprocess
import sys

from .conftest import BENCH, run_workload


def test_the_runner_runs_the_engine_and_its_peer_and_writes_every_sample(tmp_path):
    report = run_workload("single_bal_none", tmp_path / "results.json")
    assert report["format"] == "openrecipes-bench/1" and report["gpu"] == "cpu" and report["tiny"] is True
    assert report["torch"] and report["transformers"] and "peft" in report and "driver" in report
    settings = report["workloads"]["single_bal_none"]
    assert settings["peer_settings"]["recompute"] is False and settings["engine_spec"]["recompute"] == "none"
    assert [(s["side"], s["round"]) for s in report["samples"]] == [("engine", 1), ("peer", 1)]
    engine, peer = report["samples"]
    assert engine["tokens_per_s_per_gpu"] == engine["record"]["measure"]["tokens_per_s_per_gpu"] > 0
    assert peer["tokens_per_s_per_gpu"] == peer["record"]["tokens_per_s_window"] > 0
    assert peer["record"]["grad_ckpt"] is False and peer["record"]["routing"].startswith("forced")
    assert "--no-recompute" in peer["command"] and "--balanced" in peer["command"]
    assert len(engine["record"]["step_times_s"]) == len(peer["record"]["step_times_s"]) == 7


def test_a_lora_workload_runs_beside_its_peft_peer(tmp_path):
    engine, peer = run_workload("single_bal_c_lora", tmp_path / "results.json")["samples"]
    assert engine["record"]["lora"] is True and engine["tokens_per_s_per_gpu"] > 0
    assert "--lora" in peer["command"] and peer["tokens_per_s_per_gpu"] > 0
    assert peer["record"]["trainable_params"] < peer["record"]["total_params"]


def test_steps_too_few_for_the_window_are_refused_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "--workloads", "single_bal_c_lora", "--rounds", "1",
                           "--steps", "6", "--out", str(tmp_path / "r.json")], capture_output=True, text=True,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert done.returncode != 0 and "at least 7 steps" in done.stderr and not (tmp_path / "r.json").exists()


def test_an_unknown_workload_is_refused_with_the_known_ones():
    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "--workloads", "no_such", "--out", "x.json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no_such" in done.stderr and "dsv3_bal" in done.stderr
