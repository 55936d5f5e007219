"""bench/predicted.py: the planner's prediction beside each one-GPU engine sample of a results file, for the recipe
the engine trained, on the results file's GPU."""

import json

import pytest

from .conftest import BENCH, load_bench

predicted = load_bench("predicted")
RESULTS = BENCH / "results" / "families-h100.json"


def test_gpu_names_read_as_the_hardware_tables_types():
    assert predicted.gpu_type("NVIDIA H100 80GB HBM3") == "H100"
    assert predicted.gpu_type("NVIDIA H200") == "H200"
    with pytest.raises(ValueError, match="no GPU type"):
        predicted.gpu_type("cpu")


def test_each_engine_workload_is_predicted_for_its_own_recipe():
    results = json.loads(RESULTS.read_text())
    rows = {r["workload"]: r for r in predicted.compare(results)}
    assert set(rows) == set(results["workloads"])
    for name, row in rows.items():
        engine = [s["tokens_per_s_per_gpu"] for s in results["samples"] if s["workload"] == name
                  and s["side"] == "engine"]
        assert row["rounds"] == len(engine) and min(engine) <= row["measured_tokens_per_s_per_gpu"] <= max(engine)
        assert row["gpu"] == "H100" and row["predicted_tokens_per_s_per_gpu"] > 0 and row["predicted_peak_gib"] > 0
    # the LoRA workload's frozen base keeps no gradient nor optimizer state (fully fine-tuned, 20.9 B parameters would
    # hold over 200 GiB of state)
    assert rows["gptoss20b_lora_c"]["predicted_peak_gib"] < 70
