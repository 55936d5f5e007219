"""Muse Spark trains through the same engine: loss falls, fp32 tensors stay fp32, resume is exact."""

import json

import torch

from openrecipes.train import engine
from openrecipes.train.loop import train


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_muse_spark_trains_and_resumes_exactly(make_recipe, tmp_path):
    overrides = dict(model="muse-spark-tiny", precision="bf16", optimizer__precision_aware=True,
                     optimizer__moment_dtype="bf16")
    whole = train(make_recipe(run_dir=str(tmp_path / "whole"), **overrides), command="t")
    assert losses(whole)[-1] < losses(whole)[0]
    cut = make_recipe(run_dir=str(tmp_path / "cut"), **overrides)
    train(cut, command="t", stop_after=2)
    train(cut, command="t", resume=True)
    assert losses(tmp_path / "cut") == losses(whole)


def test_fp32_router_and_residual_gates_survive_bf16_training(make_recipe):
    model, _ = engine.build_model(make_recipe(model="muse-spark-tiny", precision="bf16"), torch.device("cpu"))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["model.language_model.layers.0.mlp.gate.weight"] == torch.float32
    assert dtypes["model.language_model.layers.0.attn_residual_gate.weight"] == torch.float32
    assert dtypes["model.language_model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
