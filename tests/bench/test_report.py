"""bench/report.py: BENCHMARKS.md's generated part is what the results files give today (stale: this fails), and the
generator's figures come from the samples (ratios per round, the latest file, the files it cannot read listed)."""

import json

import yaml

from .conftest import load_bench

report = load_bench("report")


def test_the_generated_part_of_benchmarks_md_is_fresh():
    current = report.BENCHMARKS.read_text()
    assert current.count(report.BEGIN) == 1 and current.count(report.END) == 1
    assert report.splice(current, report.render()) == current, "stale: run python bench/report.py"


def test_todays_deepseek_v3_ratios_come_from_its_results_file():
    samples, _ = report.collect()
    dsv3 = [s for s in samples if s["workload"] == "dsv3_bal_c" and s["source"] == "deepseek-v3-h100.json"]
    assert sorted((s["side"], s["round"]) for s in dsv3) == [("engine", 1), ("engine", 2), ("peer", 1), ("peer", 2)]


def _engine_report(date, gpu, rates):
    results = [{"variant": name, "measure": {"tokens_per_s_per_gpu": rate, "peak_memory_gib": 50.0}}
               for name, rate in rates]
    return {"benchmark": "engine_speed", "date": date, "gpu": gpu, "results": results}


def _bench_run(date, gpu, samples):
    return {"format": "openrecipes-bench/1", "date": date, "gpu": gpu, "samples": [
        {"workload": w, "round": r, "side": side, "tokens_per_s_per_gpu": rate, "peak_memory_gib": None}
        for w, r, side, rate in samples]}


def test_render_from_samples(tmp_path):
    (tmp_path / "results").mkdir()
    workloads = tmp_path / "w.yaml"
    workloads.write_text(yaml.safe_dump({"workloads": {
        "a": {"description": "a one", "peer": {"harness": "transformers_qwen3_moe"}},
        "b": {"compile": True}, "b_fp8": {"compile": True, "fp8": ["experts"], "baseline": "b"}}}))
    superseded = {"old.json": "a rerun replaced it"}
    write = lambda name, data: (tmp_path / "results" / name).write_text(json.dumps(data))  # noqa: E731
    write("1-first.json", _engine_report("2026-01-01", "GPU-X", [("a", 900.0), ("b", 100.0)]))
    write("2-run.json", _bench_run("2026-02-01", "GPU-Y", [("a", 1, "engine", 1200.0), ("a", 1, "peer", 1000.0),
                                                           ("a", 2, "engine", 1300.0), ("a", 2, "peer", 1000.0),
                                                           ("b", 1, "engine", 200.0), ("b_fp8", 1, "engine", 100.0),
                                                           ("zz", 1, "engine", 5.0)]))
    write("old.json", _engine_report("2027-01-01", "GPU-Z", [("a", 1.0)]))
    write("junk.json", {"benchmark": "something_else", "date": "2026-03-01", "gpu": "GPU-X"})
    write("cpu.json", _engine_report("2026-04-01", "cpu", [("a", 7.0)]))
    text = report.render(tmp_path / "results", workloads, superseded)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    assert set(rows) == {"`a`", "`b`", "`b_fp8`"}
    assert "1,200, 1,300" in rows["`a`"] and "**1.25x** (1.200-1.300)" in rows["`a`"]  # median of the two rounds
    assert "GPU-Y" in rows["`a`"] and "2-run.json" in rows["`a`"]  # the latest file, not the superseded one
    assert "**0.50x**" in rows["`b_fp8`"] and "`b`" in rows["`b_fp8`"]
    assert "| 200 |" in rows["`b`"]
    skipped = text.split("Results not read here")[1]
    for name in ("old.json", "junk.json", "cpu.json", "zz"):
        assert name in skipped
    write("2-run.json", _bench_run("2026-02-01", "GPU-Y", [("a", 1, "engine", 1100.0), ("a", 1, "peer", 1000.0)]))
    assert report.render(tmp_path / "results", workloads, superseded) != text  # a new sample changes the generated text
