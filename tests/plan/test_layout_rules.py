"""One home for the layout rules (config/layout.py ``layout_problems``): for each rule, a layout that breaks it is
refused with the same problem (recipe key and message) by train's check before any worker starts, by the planner's
``evaluate`` and by the tuner's refusal, and the tuner's space never offers it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from openrecipes.config.layout import LayoutConfig, layout_problems
from openrecipes.config.recipe import load_recipe, recipe_from_dict
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.host import recipe_setup
from openrecipes.train.cli import _check_layout
from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.tune.predict import Planner, Target
from openrecipes.tune.space import ModelFacts, compile_options, layout_options, rows_options

IMAGE_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-vl-moe-sft.yaml"
ROW_TOKENS = 64  # the text recipes' data.build.row_tokens


def _text_recipe(tmp_path: Path, layout: dict, **top) -> dict:
    """A tree of the tiny text model whose rows are built by data.build (never built here: the rules read its
    row_tokens)."""
    return {"model": "qwen3-moe-tiny", "run_dir": str(tmp_path / "run"), "precision": "fp32", "steps": 2,
            "global_batch": 8, "logging": {"progress": False},
            "data": {"build": {"input": "bundled", "tokenizer": "bundled", "loss_mask": "qwen3",
                               "row_tokens": ROW_TOKENS, "rows": 16, "seed": 0}},
            "layout": {"max_tokens_per_gpu": ROW_TOKENS, **layout}, **top}


# name -> (recipe tree or image-example overrides, world size, the field refused, a phrase of its message)
CASES = {
    "tp divides the heads": (dict(layout={"tp": 4, "dp": 1, "sequence_parallel": True}), 4, "tp",
                             "must divide the 4 query and 2 key/value heads"),
    "etp divides the expert FFN": (dict(layout={"etp": 4, "dp": 4}, model_overrides={"moe_intermediate_size": 30}),
                                   4, "etp", "etp=4 must divide the expert FFN width 30"),
    "pp needs pp microbatches": (dict(layout={"pp": 2, "dp": 1}, global_batch=1), 2, "pp",
                                 "pp=2 needs at least 2 microbatches per step on each data-parallel rank, got 1"),
    "vpp runs whole rounds": (dict(layout={"pp": 2, "vpp": 2, "dp": 1, "rows_per_microbatch": 2,
                                           "max_tokens_per_gpu": 2 * ROW_TOKENS}, global_batch=10),
                              2, "vpp", "runs the 5 microbatches per data-parallel rank in 2 equal rounds"),
    "aux loss without pp, tp, cp": (dict(layout={"pp": 2, "dp": 1}, moe={"aux_loss_coef": 0.01}), 2,
                                    "moe.aux_loss_coef", "is not supported with layout.pp=2"),
    "image rows without tp": (["layout.tp=2", "layout.dp=1", "layout.sequence_parallel=true"], 2, "tp",
                              "image rows train with data, expert, context and pipeline parallelism only"),
    "image towers on the first stage": (["layout.pp=3", "layout.dp=1"], 3, "pp_first_stage_layers",
                                        "must hold the first 2 decoder layers (image features are added after each); "
                                        "it holds 1"),
}


def _recipe(case, tmp_path: Path):
    spec = CASES[case][0]
    if isinstance(spec, list):  # the image-text example, its rows to be built by data.build
        return load_recipe(IMAGE_EXAMPLE, [f"run_dir={tmp_path / 'run'}", *spec])
    return recipe_from_dict(_text_recipe(tmp_path, **spec))


def _planner(recipe, world: int) -> Planner:
    build = recipe.data.build
    return Planner(recipe, Target(count=world, gpu_type="cpu"), build.row_tokens,
                   image_rows=build.image_processor is not None)


@pytest.mark.parametrize("case", CASES)
def test_train_the_planner_and_the_tuner_refuse_with_the_same_problem(case, tmp_path):
    recipe, (_, world, field, phrase) = _recipe(case, tmp_path), CASES[case]
    key = field if "." in field else f"layout.{field}"
    with pytest.raises(ValueError) as refused:
        _check_layout(recipe, recipe_model_config(recipe), world)
    train_says = str(refused.value).removesuffix(f" (--nproc x --nnodes = {world} processes)")
    assert train_says.startswith(f"{key}: ") and phrase in train_says
    planner = _planner(recipe, world)
    with pytest.raises(ValueError) as planned:
        evaluate(planner.shape, recipe.layout, recipe_setup(recipe, planner.row_tokens), load_hardware("H200"),
                 workload=planner.workload(recipe))
    assert str(planned.value) == train_says
    assert planner.refusal(recipe).startswith(train_says)  # then any other problem, after "; "


def _offered(start, facts: ModelFacts):
    """Every (layout, its workload) the space offers: each layout with each rows choice and compile setting, as
    ``candidate_recipe`` would write them."""
    for option in layout_options(start, facts):
        sizes = dict(option)
        for rows in rows_options(start, sizes):
            for compiled in compile_options(sizes):
                layout = LayoutConfig(**{**start.layout.model_dump(), **sizes, "rows_per_microbatch": rows,
                                         "max_tokens_per_gpu": -(-rows * facts.row_tokens // sizes["cp"])})
                yield layout, compiled


@pytest.mark.parametrize("case", CASES)
def test_the_space_never_offers_a_layout_the_rule_refuses(case, tmp_path):
    """The start is the refused recipe with the world over data parallelism (and the pipeline interleaving needs)."""
    refused, (_, world, field, _) = _recipe(case, tmp_path), CASES[case]
    pp = 2 if refused.layout.vpp > 1 else 1
    start = refused.model_copy(update={"layout": LayoutConfig(
        pp=pp, vpp=refused.layout.vpp, dp=world // pp, max_tokens_per_gpu=refused.layout.max_tokens_per_gpu)})
    planner = _planner(start, world)
    workload = planner.workload(start)
    facts = ModelFacts(num_layers=planner.shape.num_layers, num_experts=planner.shape.num_experts,
                       kv_heads=planner.shape.kv_heads, heads=planner.shape.heads,
                       expert_ffn=planner.shape.expert_ffn, row_tokens=planner.row_tokens, world_size=world,
                       image_rows=workload.image_rows, image_first_stage_layers=workload.image_first_stage_layers)
    offered = list(_offered(start, facts))
    assert offered  # the space holds runnable layouts
    for layout, compiled in offered:
        problems = layout_problems(layout, world_size=world, model=planner.shape.layout_model(),
                                   workload=replace(workload, compile=compiled))
        assert field not in {p.field for p in problems}, (layout.label(), problems)


def test_compile_with_tp_or_cp_is_one_rule_for_the_recipe_the_planner_and_the_space(tmp_path):
    with pytest.raises(ValueError) as refused:
        recipe_from_dict(_text_recipe(tmp_path, {"tp": 2, "dp": 1, "sequence_parallel": True},
                                      kernels={"compile": True}))
    recipe = recipe_from_dict(_text_recipe(tmp_path, {"tp": 2, "dp": 1, "sequence_parallel": True}))
    planner = _planner(recipe, 2)
    with pytest.raises(ValueError) as planned:
        evaluate(planner.shape, recipe.layout, recipe_setup(recipe, ROW_TOKENS), load_hardware("H200"),
                 workload=replace(planner.workload(recipe), compile=True))
    assert str(planned.value).startswith("kernels.compile: not supported with tensor or context parallelism")
    assert str(planned.value) in str(refused.value)
    assert compile_options({"tp": 2, "cp": 1}) == compile_options({"tp": 1, "cp": 2}) == [False]
    assert compile_options({"tp": 1, "cp": 1}) == [False, True]
