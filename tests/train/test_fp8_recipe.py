"""The recipe's fp8 section: which products it turns to FP8, what it refuses, and that a run with it trains (on CPU
the products are the emulated definition, tests/models/test_fp8.py) differently from bf16 and equally under DP2-EP2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from openrecipes.config.recipe import load_recipe
from openrecipes.models.common.fp8 import FP8_EXPERTS, Fp8Linear
from openrecipes.models.families import family_for_config
from openrecipes.models.registry import get_config
from openrecipes.parallel.fp8 import apply_fp8
from openrecipes.verify.rules import compare_recipes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_targets_choose_the_products(model):
    config = get_config(model)
    family = family_for_config(config)
    built = family.build(config, device="meta", seed=None)
    layers = family.sharding.decoder_layers(built)
    apply_fp8(layers, family.sharding, ["projections"])
    linears = {name: type(m) for name, m in built.named_modules() if isinstance(m, nn.Linear)}
    assert type(built.lm_head) is nn.Linear  # the head stays bf16
    assert all(kind is Fp8Linear for name, kind in linears.items() if ".layers." in name), linears
    assert all(block.experts.backend != FP8_EXPERTS for block in family.sharding.moe_blocks(layers))
    apply_fp8(layers, family.sharding, ["experts"])
    assert all(block.experts.backend == FP8_EXPERTS for block in family.sharding.moe_blocks(layers))


@pytest.mark.parametrize("sets, field", [
    (["precision=fp32", "optimizer.precision_aware=false", "fp8={}"], "fp8: needs precision bf16"),
    (["lora={}", "fp8={}"], "fp8: needs precision bf16, no lora"),
    (["fp8={scaling: tensorwise}"], "fp8.scaling"),
    (["fp8={targets: []}"], "fp8.targets"),
])
def test_refusals_name_the_field(sets, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_recipe(EXAMPLES / "tiny-qwen3-sft.yaml", sets)


def test_fp8_is_a_numerics_change():
    bf16 = load_recipe(EXAMPLES / "tiny-qwen3-sft.yaml")
    fp8 = load_recipe(EXAMPLES / "tiny-qwen3-sft.yaml", ["fp8={}"])
    report = compare_recipes(fp8, bf16)
    assert not report.passed and "fp8" in str(report)
    assert fp8.card_precision() == "fp8" and bf16.card_precision() == "bf16"


def _train(run_dir, *sets, nproc=1):
    args = [sys.executable, "-m", "openrecipes", "train", str(EXAMPLES / "tiny-qwen3-sft.yaml"), "--nproc",
            str(nproc), "--set", f"run_dir={run_dir}", "--set", "steps=3", "--set", "logging.progress=false",
            "--set", "checkpoint.every=null"]
    for item in sets:
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_fp8_run_trains_close_to_bf16_and_equally_under_dp2_ep2(tmp_path):
    bf16 = _train(tmp_path / "bf16")
    fp8 = _train(tmp_path / "fp8", "fp8={}")
    # FP8 is in effect (other losses) and close (e4m3 rounding of the products: well under 1 % here)
    assert all(a["loss"] != b["loss"] for a, b in zip(fp8, bf16))
    assert all(abs(a["loss"] / b["loss"] - 1) < 0.01 for a, b in zip(fp8, bf16))
    parallel = _train(tmp_path / "dp2ep2", "fp8={}", "layout.dp=2", "layout.ep=2", nproc=2)
    for a, b in zip(parallel, fp8):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)  # bf16 runs: reductions in another order


def _word_rows(tmp_path, rows: int) -> Path:
    """Pretraining rows of random words from a 3,000-word vocabulary, none repeated: a loss curve that learns the
    words' distribution rather than memorising the rows (where small differences compound)."""
    import random

    rng = random.Random(0)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                  for _ in range(3000)]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choices(vocabulary, k=rng.randint(200, 800)))}) + "\n"
                            for _ in range(600)))
    out = tmp_path / "rows"
    built = subprocess.run([sys.executable, "-m", "openrecipes", "data", "build", str(docs), "--format", "pretrain",
                            "--row-tokens", "256", "--rows", str(rows), "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    return out


@pytest.mark.slow
def test_fp8_passes_the_convergence_check_against_bf16(tmp_path):
    """The FP8 run of a recipe against its bf16 run over 120 steps of rows seen once: `openrecipes verify
    convergence`'s checks (Megatron-Bridge's statistics: correlation, pointwise and final loss, outliers) pass. Tiny
    widths on CPU, where the FP8 products are their emulated definition; not a GPU measurement."""
    from openrecipes.verify.convergence import check_convergence
    from openrecipes.verify.curves import read_run_dir_curve

    rows = _word_rows(tmp_path, rows=120 * 8)
    sets = ("steps=120", "data.build=null", f"data.rows={rows}", "checkpoint.at_end=false")
    _train(tmp_path / "bf16", *sets)
    _train(tmp_path / "fp8", *sets, "fp8={}")
    fp8, bf16 = read_run_dir_curve(tmp_path / "fp8"), read_run_dir_curve(tmp_path / "bf16")
    assert fp8.losses != bf16.losses  # FP8 is in effect: two equal curves would pass as well
    report = check_convergence(fp8, bf16)
    assert report.passed, report.to_dict()
    assert len(report.compared_steps) > 80
