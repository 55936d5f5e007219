"""The README's main job, shortened: `openrecipes demo` end to end on CPU."""

import json
import subprocess
import sys

import yaml

from openrecipes.demo import what_it_shows


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "openrecipes", "demo", "--out", str(out), "--steps", "8"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["checks"].values()) == {"pass"}
    assert summary["runs"]["candidate"]["gpus"] == 2
    assert (out / "site" / "index.html").is_file()
    # the demo's site shows the published cards beside its own
    assert (out / "site" / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.html").is_file()
    assert (out / "site" / "qwen3-moe-tiny" / "cpu" / "demo-candidate.html").is_file()
    assert "models/qwen3-moe-tiny.html" in (out / "site" / "index.html").read_text()
    assert "demo-candidate.yaml --nproc 2" in (out / "site" / "models" / "qwen3-moe-tiny.html").read_text()
    card = out / "recipes" / "qwen3-moe-tiny" / "cpu" / "demo-candidate.yaml"
    assert "correctness:" in card.read_text()
    assert (out / "verify" / "convergence.svg").is_file()
    assert "look at:" in result.stdout
    # the card and the summary say what the demo shows: a checked layout change, faster or slower as measured
    shows = summary["what_it_shows"]
    ratio = summary["runs"]["candidate"]["tokens_per_s_per_gpu"] / summary["runs"]["reference"]["tokens_per_s_per_gpu"]
    assert f"{ratio:.2f}x" in shows and ("slower" in shows) == (ratio < 1)
    assert shows in result.stdout
    assert "What the demo shows" in yaml.safe_load(card.read_text())["notes"]

    # a second run replaces the previous demo output, but never an unrelated directory
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    refused = subprocess.run([sys.executable, "-m", "openrecipes", "demo", "--out", str(other), "--steps", "6"],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "was not written by openrecipes demo" in refused.stderr
    assert (other / "keep.txt").read_text() == "x"


def test_what_the_demo_shows_follows_the_measurement():
    def measured(reference, candidate):
        return {"reference": {"tokens_per_s_per_gpu": reference}, "candidate": {"tokens_per_s_per_gpu": candidate}}

    slower = what_it_shows(measured(2417.0, 1138.0), nproc=2, gpus=0)
    assert "0.47x" in slower and "slower" in slower and "DP2 EP2" in slower and "CPU" in slower
    assert "not a faster recipe" in slower
    faster = what_it_shows(measured(1000.0, 1500.0), nproc=2, gpus=2)
    assert "faster (1.50x" in faster and "2 GPU(s)" in faster
