"""Muse Spark trains through the same engine: loss falls, fp32 tensors stay fp32 (from random init and from a
Hugging Face checkpoint), resume is exact, and a model with pinned tensors below fp32 never starts training."""

import json
from pathlib import Path

import pytest
import torch

from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.checkpoint.hf import save_hf
from openrecipes.models.common.precision import fp32_parameter_names
from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.registry import get_config
from openrecipes.train import engine
from openrecipes.train.loop import train
from openrecipes.parallel.mesh import single_process


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
    recipe = make_recipe(model="muse-spark-tiny", precision="bf16")
    model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["model.language_model.layers.0.mlp.gate.weight"] == torch.float32
    assert dtypes["model.language_model.layers.0.attn_residual_gate.weight"] == torch.float32
    assert dtypes["model.language_model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16


def _pinned_dtypes(model):
    params = dict(model.named_parameters())
    return {params[name].dtype for name in fp32_parameter_names(model)}


def test_init_from_checkpoint_keeps_fp32_tensors_and_resumes_exactly(make_recipe, tmp_path, monkeypatch):
    source = build_muse_spark(get_config("muse-spark-tiny"), seed=7)  # fp32 values a bf16 load would round
    save_hf(source, tmp_path / "hf")
    built = []
    real_build = engine.build_model

    def recording_build(*args, **kwargs):
        model, grads = real_build(*args, **kwargs)
        built.append(model)
        return model, grads

    monkeypatch.setattr(engine, "build_model", recording_build)
    overrides = dict(model=str(tmp_path / "hf"), init="checkpoint", precision="bf16")
    whole = make_recipe(run_dir=str(tmp_path / "whole"), **overrides)
    train(whole, command="t", stop_after=0)  # one step, so the built model still holds the loaded values
    first = built[-1]
    pinned = fp32_parameter_names(first)
    assert len(pinned) == 16 and _pinned_dtypes(first) == {torch.float32}
    original = dict(source.named_parameters())
    bias = "model.language_model.layers.0.mlp.gate.expert_bias"  # frozen: still exactly the file's values
    assert torch.equal(dict(first.named_parameters())[bias], original[bias])

    whole = make_recipe(run_dir=str(tmp_path / "whole6"), **overrides)
    train(whole, command="t")
    cut = make_recipe(run_dir=str(tmp_path / "cut"), **overrides)
    train(cut, command="t", stop_after=2)
    train(cut, command="t", resume=True)
    assert _pinned_dtypes(built[-1]) == {torch.float32}
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole6")


def test_a_model_with_bf16_pinned_tensors_fails_before_the_first_step(make_recipe, monkeypatch):
    real_build = engine.build_model

    def lossy_build(*args, **kwargs):  # what from_hf(dtype=bf16) used to return: the router weight rounded
        model, grads = real_build(*args, **kwargs)
        gate = model.model.language_model.layers["1"].mlp.gate
        gate.weight.data = gate.weight.data.to(torch.bfloat16)
        return model, grads

    monkeypatch.setattr(engine, "build_model", lossy_build)
    recipe = make_recipe(model="muse-spark-tiny", precision="bf16")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate\.weight \(bfloat16\)"):
        train(recipe, command="t")
    assert not (Path(recipe.run_dir) / "metrics.jsonl").exists()
