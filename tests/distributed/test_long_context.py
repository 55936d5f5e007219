"""Long rows (4,096 tokens) through context parallelism with data, tensor and pipeline parallelism, packed and
single documents, against one process (fp32, gloo, CPU). The recipes' 32,768 / 65,536-token rows are a size; the
mechanism (each cp rank a contiguous half of the row, keys and values gathered, the causal, document and
window masks at the right offsets) is the same at 4,096.

Every layout runs in one 4-process launch (tests/distributed/long_context_worker.py) to pay for one start-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

from openrecipes.data import bundled
from openrecipes.data.batching import RowLoader, load_rows
from openrecipes.config.recipe import DataBuild
from openrecipes.data.build import build
from tests.distributed.test_layouts import assert_same, metrics

ROW = 4096
COMMON = ["precision=fp32", "optimizer.precision_aware=false", "steps=1", "logging.progress=false",
          "checkpoint.every=null", "checkpoint.at_end=false", "recompute.granularity=none", "global_batch=2",
          "data.build=null"]
ONE_PROCESS = ["layout.dp=1", f"layout.max_tokens_per_gpu={ROW}"]
# each cp rank holds half a row: 2,048 tokens (1,024 per tp rank with TP2)
LAYOUTS = {
    "CP2-DP2": ["layout.cp=2", "layout.dp=2", f"layout.max_tokens_per_gpu={ROW // 2}"],
    "TP2-CP2": ["layout.tp=2", "layout.sequence_parallel=true", "layout.cp=2", "layout.dp=1",
                f"layout.max_tokens_per_gpu={ROW // 2}"],
    "PP2-CP2": ["layout.pp=2", "layout.cp=2", "layout.dp=1", f"layout.max_tokens_per_gpu={ROW // 2}"],
}


def _rows(tmp_path: Path) -> Path:
    """Two rows of one global batch: one packed (dozens of short documents straddling the cp boundary) and one
    single document (a long text cut by the row boundaries, so every window near the middle crosses it)."""
    texts = [json.loads(line)["text"] for line in
             Path(bundled.resolve("bundled", bundled.default_input("pretrain"))).read_text().splitlines()]
    documents = ["\n\n".join(texts[:150]), *texts[150:260]]
    (tmp_path / "documents.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    out = tmp_path / "rows"
    build(DataBuild(input=str(tmp_path / "documents.jsonl"), format="pretrain", row_tokens=ROW, rows=2, seed=0,
                    eos_token="<|endoftext|>"), out, progress=False)
    loader = RowLoader(dataset=load_rows(out), global_batch=2, dp_rank=0, dp_size=1, rows_per_microbatch=1)
    documents_per_row = sorted(len(batch["cu_seqlens"]) - 1 for batch in loader.microbatches(0))
    assert documents_per_row[0] == 1 and documents_per_row[1] > 10, \
        f"the build's seeded order changed: choose a seed giving one single-document and one packed row, got " \
        f"{documents_per_row} documents per row"
    return out


def _launch(runs: list[dict], spec: Path, nproc: int) -> None:
    spec.write_text(json.dumps(runs))
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"] if nproc > 1 else []
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root / "src"), str(root), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, *launcher, "-m", "tests.distributed.long_context_worker", str(spec)],
                            capture_output=True, text=True, timeout=900, cwd=root,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr[-4000:]


def test_long_rows_through_context_parallel_layouts_match_one_process(tmp_path):
    rows = _rows(tmp_path)
    # Muse Spark's sliding-window layers (window 16): the second cp rank's first queries reach back into the first
    # rank's keys, in the single document and in the packed documents that straddle the boundary
    cases = {(layout, "qwen3-moe-tiny"): sets for layout, sets in LAYOUTS.items()}
    cases[("CP2-DP2", "muse-spark-tiny")] = LAYOUTS["CP2-DP2"]

    def run(name, model, sets):
        return {"overrides": [*COMMON, f"model={model}", f"data.rows={rows}", *sets],
                "run_dir": str(tmp_path / "runs" / f"{name}-{model}")}

    _launch([run("one", model, ONE_PROCESS) for model in sorted({m for _, m in cases})], tmp_path / "one.json", 1)
    _launch([run(*case, sets) for case, sets in cases.items()], tmp_path / "four.json", 4)
    for name, model in cases:
        candidate, reference = metrics(tmp_path / "runs" / f"{name}-{model}"), metrics(tmp_path / "runs" / f"one-{model}")
        assert candidate[0]["tokens"] == 2 * ROW
        assert_same(candidate, reference)
