"""The README's main job, shortened: `openrecipes demo` end to end on CPU."""

import json
import subprocess
import sys


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

    # a second run replaces the previous demo output, but never an unrelated directory
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    refused = subprocess.run([sys.executable, "-m", "openrecipes", "demo", "--out", str(other), "--steps", "6"],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "was not written by openrecipes demo" in refused.stderr
    assert (other / "keep.txt").read_text() == "x"
