"""The router load-balancing loss in training (moe.aux_loss_coef): off by default, transformers' loss when on."""

import json

import pytest
import torch

from openrecipes.models.common.router_loss import RouterStatistics
from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.train import engine
from openrecipes.train.loop import train
from openrecipes.parallel.mesh import single_process


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_off_by_default(make_recipe):
    recipe = make_recipe(steps=1)
    assert recipe.moe.aux_loss_coef == 0.0
    assert "aux_loss" not in records(train(recipe, command="t"))[0]


def test_step_objective_is_cross_entropy_plus_the_mean_of_the_rows_aux_loss(make_recipe):
    """Two microbatches of two rows: the logged aux loss is the mean over the four rows of transformers' loss on each
    row alone (all its tokens: packed rows carry no padding mask), and the gradient norm is that of per-token cross
    entropy + coef * that mean."""
    from openrecipes.data.batching import RowLoader, load_rows

    coef = 0.05
    recipe = make_recipe(steps=1, moe__aux_loss_coef=coef, optimizer__grad_clip=None)
    logged = records(train(recipe, command="t"))[0]

    model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
    loader = RowLoader(dataset=load_rows(recipe.data.rows), global_batch=4, dp_rank=0, dp_size=1,
                       rows_per_microbatch=4)
    (batch,) = loader.microbatches(0)
    supervised = float(engine.loss_weights(batch).sum())
    objective, aux_mean = engine.microbatch_loss_sum(model, batch) / supervised, 0.0
    for row in range(4):  # each row through the model alone, pooled over all of it (RouterStatistics' default)
        with RouterStatistics(model) as routing:
            model(batch["input_ids"][row:row + 1], batch["position_ids"][row:row + 1],
                  _documents(batch, row))
        aux = routing.load_balancing_loss()
        objective = objective + coef * aux / 4
        aux_mean += aux.item() / 4
    objective.backward()
    grad_norm = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None]).norm()
    assert logged["aux_loss"] == pytest.approx(aux_mean, rel=1e-6)
    assert logged["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)
    assert aux_mean == pytest.approx(2.0, rel=0.1)  # top_k when routing is near uniform (transformers' test: 2)


def _documents(batch, row):
    from openrecipes.models.common.attention import Documents

    return Documents.from_document_ids(batch["document_ids"][row:row + 1])


def test_aux_loss_does_not_depend_on_the_microbatch_size(make_recipe, tmp_path):
    one = records(train(make_recipe(steps=2, moe__aux_loss_coef=0.1, layout__max_tokens_per_gpu=256,
                                    run_dir=str(tmp_path / "a")), command="t"))
    four = records(train(make_recipe(steps=2, moe__aux_loss_coef=0.1, layout__max_tokens_per_gpu=64,
                                     run_dir=str(tmp_path / "b")), command="t"))
    for a, b in zip(one, four):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_aux_loss_changes_the_updates(make_recipe, tmp_path):
    plain = records(train(make_recipe(steps=2, run_dir=str(tmp_path / "a")), command="t"))
    balanced = records(train(make_recipe(steps=2, run_dir=str(tmp_path / "b"), moe__aux_loss_coef=0.5),
                             command="t"))
    assert balanced[0]["loss"] == plain[0]["loss"] and balanced[0]["grad_norm"] != plain[0]["grad_norm"]
    assert balanced[1]["loss"] != plain[1]["loss"]


@pytest.mark.parametrize("sizes, name", [({"pp": 2}, "layout.pp=2"), ({"tp": 2, "sequence_parallel": True},
                                                                  "layout.tp=2"), ({"cp": 2}, "layout.cp=2")])
def test_layouts_that_split_the_pooled_statistics_are_refused(make_recipe, rows_dir, sizes, name):
    def problems(**overrides):
        recipe = make_recipe(layout__dp=1, **{f"layout__{k}": v for k, v in sizes.items()}, **overrides)
        return engine.layout_problems_for(recipe, recipe_model_config(recipe), world_size=2, rows=rows_dir)

    refused = problems(moe__aux_loss_coef=0.01)
    assert [p.path for p in refused] == ["moe.aux_loss_coef"]
    assert refused[0].message.startswith(f"moe.aux_loss_coef=0.01 is not supported with {name}")
    assert problems() == []  # off: fine


def test_muse_spark_and_a_mismatched_checkpoint_config_are_refused(make_recipe):
    recipe = make_recipe(model="muse-spark-tiny", moe__aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="moe.aux_loss_coef=0.01.*MuseSparkConfig"):
        engine.check_aux_loss(recipe, recipe_model_config(recipe))
    asks = make_recipe(model_overrides={"output_router_logits": True, "router_aux_loss_coef": 0.001})
    with pytest.raises(ValueError, match="output_router_logits=true, router_aux_loss_coef=0.001"):
        engine.check_aux_loss(asks, recipe_model_config(asks))
    matched = make_recipe(moe__aux_loss_coef=0.001,
                          model_overrides={"output_router_logits": True, "router_aux_loss_coef": 0.001})
    engine.check_aux_loss(matched, recipe_model_config(matched))


def test_support_is_what_the_family_declares(make_recipe, monkeypatch):
    # a family without ``aux_loss`` has the loss refused, even with a config holding router_aux_loss_coef; the
    # image-text Qwen3 family declares its decoder's
    from dataclasses import replace

    from openrecipes.models import families
    from openrecipes.models.registry import families as registered

    recipe = make_recipe(moe__aux_loss_coef=0.01)
    config = recipe_model_config(recipe)
    undeclared = replace(families.family_for_config(config), aux_loss=None)
    monkeypatch.setattr(families, "_families", lambda: (undeclared,))
    assert hasattr(config, "router_aux_loss_coef")
    with pytest.raises(ValueError, match="moe.aux_loss_coef=0.01.*Qwen3MoeConfig"):
        engine.check_aux_loss(recipe, config)
    monkeypatch.undo()
    declared = {family.name: family.aux_loss for family in registered()}
    assert declared["qwen3_vl_moe"] is declared["qwen3_moe"] is not None


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_changes_no_number_with_the_aux_loss(make_recipe, tmp_path, granularity):
    plain = records(train(make_recipe(steps=2, moe__aux_loss_coef=0.1, run_dir=str(tmp_path / "a")), command="t"))
    again = records(train(make_recipe(steps=2, moe__aux_loss_coef=0.1, run_dir=str(tmp_path / "b"),
                                      recompute__granularity=granularity), command="t"))
    for a, b in zip(plain, again):
        assert (a["loss"], a["aux_loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["aux_loss"], b["grad_norm"]),
                                                                          rel=1e-6)
