"""Training DeepSeek-V3's multi-token-prediction layer (recipe mtp) in one process: the step's objective over its
microbatches, the metric, the export holding the layer; a run without mtp neither holds nor exports it; the
combinations not supported yet (LoRA; pipeline, tensor and context parallelism) are refused up front, naming the
field."""

import json
from pathlib import Path

import pytest
import torch

from openrecipes.checkpoint.hf import from_hf, recipe_model_config
from openrecipes.parallel.mesh import single_process
from openrecipes.train import engine
from openrecipes.train.loop import train
from openrecipes.train.mtp_loss import MtpObjective

DEEPSEEK = dict(model="deepseek-v3-tiny", model_overrides={"num_nextn_predict_layers": 1})


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_step_objective_adds_the_weighted_mtp_loss_over_the_whole_batch(make_recipe):
    """Two microbatches of two rows: the logged gradient norm is that of main / N + weight · MTP / N_1 over the four
    rows at once (the MTP targets counted over the step, like the main loss's), and mtp_loss is MTP / N_1."""
    from openrecipes.data.batching import RowLoader, load_rows

    recipe = make_recipe(steps=1, mtp={"loss_weight": 0.3}, optimizer__grad_clip=None,
                         layout__max_tokens_per_gpu=128, **DEEPSEEK)  # 64-token rows: 2 a microbatch
    logged = records(train(recipe, command="t"))[0]

    model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
    assert model.model.mtp_layers is not None
    loader = RowLoader(dataset=load_rows(recipe.data.rows), global_batch=4, dp_rank=0, dp_size=1,
                       rows_per_microbatch=4)
    (batch,) = loader.microbatches(0)
    mtp = MtpObjective(0.3, 1, [batch], torch.device("cpu"))
    main = engine.microbatch_loss_sum(model, batch, mtp=mtp)
    (main / engine.loss_weights(batch).sum() + mtp.take()).backward()
    grad_norm = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None]).norm()
    assert logged["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)
    assert logged["mtp_loss"] == pytest.approx(mtp.per_token_loss(), rel=1e-6)
    assert logged["loss"] == pytest.approx(main.item() / engine.loss_weights(batch).sum().item(), rel=1e-6)
    assert 0.5 < logged["mtp_loss"] / logged["loss"] < 2  # near log(vocabulary) both, at initialisation


def test_the_chunked_loss_head_computes_the_same_mtp_term(make_recipe):
    """With kernels.loss_chunk_tokens the MTP depths' loss runs through the chunked head too (no logits held whole)."""
    from openrecipes.data.batching import RowLoader, load_rows

    def objective_and_grads(chunk):
        recipe = make_recipe(mtp={"loss_weight": 0.3}, kernels__loss_chunk_tokens=chunk, **DEEPSEEK)
        model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
        loader = RowLoader(dataset=load_rows(recipe.data.rows), global_batch=4, dp_rank=0, dp_size=1,
                           rows_per_microbatch=4)
        (batch,) = loader.microbatches(0)
        mtp = MtpObjective(0.3, 1, [batch], torch.device("cpu"))
        main = engine.microbatch_loss_sum(model, batch, mtp=mtp)
        term = mtp.take()
        (main + term).backward()
        return main.item(), term.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (main, term, grads), (main_c, term_c, grads_c) = objective_and_grads(0), objective_and_grads(24)
    assert main_c == pytest.approx(main, rel=1e-5) and term_c == pytest.approx(term, rel=1e-5) and term > 0
    assert grads.keys() == grads_c.keys()
    for name, grad in grads.items():
        assert torch.allclose(grads_c[name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item()), name


def test_the_export_holds_the_trained_mtp_layer_and_a_run_without_mtp_none(make_recipe, tmp_path):
    trained = train(make_recipe(steps=2, mtp={}, checkpoint__export_hf=True, **DEEPSEEK), command="t")
    assert all(r["mtp_loss"] > 0 for r in records(trained))
    model = from_hf(trained / "hf")
    assert model.config.mtp_layers == 1 and model.model.mtp_layers is not None
    hf_config = json.loads((trained / "hf" / "config.json").read_text())
    assert hf_config["num_nextn_predict_layers"] == 1

    # a run starting from that export trains its MTP layer on; one without mtp leaves it out, saying so
    resumed = train(make_recipe(steps=1, model=str(trained / "hf"), init="checkpoint", mtp={},
                                run_dir=str(tmp_path / "from_export")), command="t")
    assert records(resumed)[0]["mtp_loss"] < records(trained)[0]["mtp_loss"]
    note = r"skipped \d+ tensor\(s\) of the multi-token-prediction layer model\.layers\.3"
    with pytest.warns(UserWarning, match=note):
        without = train(make_recipe(steps=1, model=str(trained / "hf"), init="checkpoint",
                                    run_dir=str(tmp_path / "without")), command="t")
    assert "mtp_loss" not in records(without)[0]

    plain = train(make_recipe(steps=1, checkpoint__export_hf=True, run_dir=str(tmp_path / "plain"), **DEEPSEEK),
                  command="t")
    assert "mtp_loss" not in records(plain)[0]
    assert json.loads((plain / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert from_hf(plain / "hf").model.mtp_layers is None


@pytest.mark.parametrize("changes, message", [
    (dict(model="qwen3-moe-tiny"), r"mtp: the model 'qwen3-moe-tiny' has no multi-token-prediction layers"),
    (dict(model="deepseek-v3-tiny"), r"num_nextn_predict_layers, settable in model_overrides"),
    (dict(lora={}, **DEEPSEEK), r"mtp: not with lora"),
])
def test_what_is_not_supported_is_refused_naming_the_field(make_recipe, changes, message):
    recipe = make_recipe(mtp={"loss_weight": 0.1}, **changes)
    with pytest.raises(ValueError, match=message):
        engine.check_mtp(recipe, recipe_model_config(recipe))


@pytest.mark.parametrize("layout, refused", [
    (dict(dp=2), None), (dict(dp=2, ep=2), None),
    (dict(dp=1, pp=2, pp_first_stage_layers=1), "pp"), (dict(dp=1, tp=2), "tp"), (dict(dp=1, cp=2), "cp"),
])
def test_layouts_that_split_the_model_or_the_row_are_refused_naming_mtp_and_the_field(make_recipe, layout, refused):
    """Data and expert parallelism train MTP (tests/distributed/test_mtp_layouts.py); a pipeline stage lacks the
    embedding or the head, a context or sequence shard the next shard's first token."""
    from openrecipes.config.layout import LayoutError

    recipe = make_recipe(mtp={}, layout={"max_tokens_per_gpu": 128, **layout}, **DEEPSEEK)
    rows = Path(recipe.data.rows)
    problems = engine.layout_problems_for(recipe, recipe_model_config(recipe), world_size=2, rows=rows)
    without = engine.layout_problems_for(make_recipe(layout={"max_tokens_per_gpu": 128, **layout}, **DEEPSEEK),
                                         recipe_model_config(recipe), world_size=2, rows=rows)
    assert without == []  # the layout itself runs the model
    if refused is None:
        assert problems == []
    else:
        assert [str(LayoutError(p)) for p in problems] == [
            f"layout.{refused}: mtp is not supported with layout.{refused}=2: multi-token prediction trains with "
            "data and expert parallelism only"]


def test_a_loss_weight_must_be_positive(make_recipe):
    with pytest.raises(ValueError, match=r"mtp\.loss_weight"):
        make_recipe(mtp={"loss_weight": 0}, **DEEPSEEK)
