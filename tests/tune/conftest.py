"""Fixtures of the tuner's tests: a deliberately slow starting recipe of the tiny model over two processes, rows built
once, and a synthetic runner that writes run directories without training (the real runs are in test_tune_slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from openrecipes.config.recipe import load_recipe
from openrecipes.config.rundir import METRICS_FILE, RECIPE_FILE, RunGpuInfo, RunInfo, RunModelInfo, write_run_info
from openrecipes.tune.runner import Outcome, TrialRun, measure_trial

SLOW_START = {
    "name": "slow-start", "model": "qwen3-moe-tiny",
    "layout": {"dp": 2, "ep": 1, "max_tokens_per_gpu": 256},          # one row per microbatch
    "recompute": {"granularity": "full"},                              # and every layer recomputed
    "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "weight_decay": 0.1, "warmup_fraction": 0.1,
                  "precision_aware": True, "moment_dtype": "bf16"},
    "precision": "bf16", "steps": 20, "global_batch": 8, "seed": 0, "run_dir": "runs/slow-start",
    "logging": {"progress": False},
}
BUILD = {"input": "bundled", "tokenizer": "bundled", "loss_mask": "qwen3", "row_tokens": 256, "rows": 64, "seed": 42}


@pytest.fixture(scope="session")
def rows_dir(tmp_path_factory) -> Path:
    from openrecipes.data.build import build_recipe_rows
    from openrecipes.config.recipe import DataBuild

    return build_recipe_rows(DataBuild(**BUILD), tmp_path_factory.mktemp("rows") / "rows")


def write_start(path: Path, rows: Path | None = None, **changes) -> Path:
    tree = json.loads(json.dumps(SLOW_START))
    tree["data"] = {"rows": str(rows)} if rows else {"build": dict(BUILD)}
    tree.update(changes)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


@pytest.fixture
def start_yaml(tmp_path, rows_dir) -> Path:
    return write_start(tmp_path / "start.yaml", rows_dir)


def synthetic_step_time(recipe) -> float:
    """A cost model the search has to discover: a fixed cost per microbatch, more for recompute, offload slower."""
    rows = recipe.layout.rows_per_microbatch or max(1, recipe.layout.max_tokens_per_gpu * recipe.layout.cp // 256)
    microbatches = recipe.global_batch // recipe.layout.dp // rows
    factor = {"none": 1.0, "attention_core": 1.05, "experts": 1.1, "selective": 1.15,
              "full_keep_attention": 1.3, "full": 1.4}[recipe.recompute.granularity]
    return 0.05 * microbatches * factor + 0.02 * rows * factor + 0.05 * recipe.offload.fraction


class SyntheticRunner:
    """Writes what train would (recipe.yaml, run.json, metrics.jsonl) with the synthetic step time and one loss curve
    for every recipe (the numerics are the same), then measures it for real. A recipe with debug.fail_at crashes."""

    def __init__(self, interrupt_at: int | None = None, peaks=None, step_time=synthetic_step_time) -> None:
        self.calls: list[Path] = []
        self.interrupt_at = interrupt_at
        self.peaks = peaks  # recipe -> (peak allocated, peak reserved) GiB each step records; None: not measured
        self.step_time = step_time  # recipe -> seconds of each step

    def run(self, trial: TrialRun, tick=None) -> Outcome:
        self.calls.append(trial.run_dir)
        recipe = load_recipe(trial.recipe_path)
        run_dir = trial.run_dir
        run_dir.mkdir(parents=True)
        (run_dir / RECIPE_FILE).write_text(trial.recipe_path.read_text())
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            (run_dir / "half-written").write_text("killed here")
            raise KeyboardInterrupt
        if recipe.debug.fail_at is not None:
            return Outcome(failure="crash", detail="injected failure (debug.fail_at)", wall_s=1.0)
        write_run_info(run_dir, RunInfo(
            command=f"openrecipes train {trial.recipe_path} --nproc {trial.nproc}", started="2026-12-01T00:00:00Z",
            model=RunModelInfo(name=recipe.model, active_params=190464, num_layers=4, hidden_size=64,
                               num_attention_heads=4, head_dim=24),
            gpu=RunGpuInfo(type="cpu", count=2), world_size=2, global_batch=8, row_tokens=256, steps=recipe.steps))
        step_time = self.step_time(recipe)
        allocated, reserved = self.peaks(recipe) if self.peaks else (None, None)
        lines = [json.dumps({"step": s, "loss": 7.0 - 0.1 * s + 0.01 * (s % 3), "grad_norm": 1.0, "tokens": 2048,
                             "supervised_tokens": 700, "sum_doc_len_sq": 300000, "step_time_s": step_time,
                             "peak_memory_gib": allocated, "peak_reserved_gib": reserved})
                 for s in range(recipe.steps)]
        (run_dir / METRICS_FILE).write_text("\n".join(lines) + "\n")
        return Outcome(measured=measure_trial(run_dir, trial.window), wall_s=recipe.steps * step_time)
