"""A LoRA run's frozen base stays bf16 under several processes (precision bf16, fp32 adapter masters): on every rank
of DP2-EP2 (FSDP2 shards the dense base, expert parallelism the experts) and TP2-EP2 with sequence parallelism (no
FSDP: the fp32 adapters meet bf16 activations) the base's parameters are bf16 and the adapters' fp32; the losses equal
one bf16 process's within 1e-4 (relative; bf16 forward and backward summed in other orders: both layouts measured
under 1.5e-5 over three steps, gradient norms under 0.25 %, compared at 1 %), and what each DP2-EP2 rank holds is what
the planner predicts (plan/memory.py: bf16 base shards, fp32 adapter shards). One launch of two processes runs both
layouts (tests/distributed/lora_precision_worker.py); the one process runs in the test's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrecipes.config.layout import LayoutConfig
from openrecipes.models.registry import get_config
from openrecipes.plan.lora import LoraSetup, adapter_params
from openrecipes.plan.memory import sharded_elements, stage_params
from openrecipes.plan.shape import model_shape
from tests.distributed.test_layouts import metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-lora.yaml"
COMMON = ["precision=bf16", "optimizer.precision_aware=false", "steps=2", "global_batch=8", "logging.progress=false",
          "checkpoint.every=null", "checkpoint.at_end=false", "layout.max_tokens_per_gpu=256", "optimizer.eps=1e-3"]
LAYOUTS = {
    "DP2-EP2": ["layout.dp=2", "layout.ep=2"],
    "TP2-EP2-SP": ["layout.dp=1", "layout.tp=2", "layout.sequence_parallel=true", "layout.ep=2"],
}


def _launch(runs: list[dict], spec: Path, nproc: int) -> None:
    spec.write_text(json.dumps(runs))
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"] if nproc > 1 else []
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, *launcher, "-m", "tests.distributed.lora_precision_worker", str(spec)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr[-4000:]


def _held(run_dir: Path, ranks: int) -> list[dict]:
    return [json.loads((run_dir / f"params-rank{rank}.json").read_text()) for rank in range(ranks)]


def test_frozen_base_stays_bf16_under_several_processes(tmp_path):
    from openrecipes.config.recipe import load_recipe
    from openrecipes.config.rundir import rows_directory
    from openrecipes.data.build import build_recipe_rows
    from openrecipes.train.loop import train

    recipe = load_recipe(EXAMPLE, ["data.build.rows=16", f"run_dir={tmp_path / 'rows'}"])
    rows = build_recipe_rows(recipe.data.build, rows_directory(None, recipe.run_dir))

    def run(name: str, sets: list[str]) -> dict:
        return {"example": str(EXAMPLE), "run_dir": str(tmp_path / name),
                "overrides": [*COMMON, f"data.rows={rows}", "data.build=null", *sets]}

    one = run("one", [])
    train(load_recipe(EXAMPLE, [*one["overrides"], f"run_dir={one['run_dir']}"]), command="test")  # in this process
    _launch([run(name, sets) for name, sets in LAYOUTS.items()], tmp_path / "two.json", 2)
    reference = metrics(tmp_path / "one")
    for name in LAYOUTS:
        for rank, held in enumerate(_held(tmp_path / name, 2)):
            assert (held["base"]["dtypes"], held["adapters"]["dtypes"]) == (["bfloat16"], ["float32"]), (name, rank)
        candidate = metrics(tmp_path / name)
        assert [r["step"] for r in candidate] == [r["step"] for r in reference]
        for c, r in zip(candidate, reference):
            assert c["loss"] == pytest.approx(r["loss"], rel=1e-4), (name, c["step"])
            assert c["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-2), (name, c["step"])
    # the planner's resident weights of a DP2-EP2 rank: bf16 base shards and fp32 adapter shards
    layout = LayoutConfig(max_tokens_per_gpu=256, dp=2, ep=2)
    shape = model_shape(get_config("qwen3-moe-tiny"))
    lora = LoraSetup(rank=recipe.lora.rank, targets=tuple(recipe.lora.targets))
    base = sharded_elements(*stage_params(shape, layout, shape.num_layers, first=True, last=True), layout)
    adapters = sharded_elements(*adapter_params(shape, layout, lora, shape.num_layers), layout)
    held = _held(tmp_path / "DP2-EP2", 2)
    assert sum(h["base"]["bytes"] for h in held) / 2 == 2 * base
    assert sum(h["adapters"]["bytes"] for h in held) / 2 == 4 * adapters
