"""The block method of recompute (the first N layers of each stage) in the planner: memory and step time lie between
recomputing no layer and every layer, move monotonically with N, and N = every layer is the uniform method."""

from __future__ import annotations

from openrecipes.config.recipe import recipe_from_dict
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.host import recipe_setup
from openrecipes.plan.shape import model_shape
from openrecipes.checkpoint.hf import recipe_model_config

LAYERS = 8


def _recipe(granularity: str, method: str = "uniform", num_layers: int = 1):
    return recipe_from_dict({
        "name": "block", "model": "qwen3-30b-a3b", "model_overrides": {"num_hidden_layers": LAYERS},
        "data": {"rows": "rows"}, "layout": {"max_tokens_per_gpu": 8192, "rows_per_microbatch": 1},
        "recompute": {"granularity": granularity, "method": method, "num_layers": num_layers},
        "optimizer": {"precision_aware": True, "moment_dtype": "bf16"}, "precision": "bf16", "global_batch": 2, "steps": 4})


def _shape(recipe):
    return model_shape(recipe_model_config(recipe), name=recipe.model)


def _plan(granularity: str, method: str = "uniform", num_layers: int = 1):
    recipe = _recipe(granularity, method, num_layers)
    return evaluate(_shape(recipe), recipe.layout, recipe_setup(recipe, 8192), load_hardware("H200"))


def test_block_recompute_lies_between_none_and_every_layer():
    none, full = _plan("none"), _plan("full")
    blocks = [_plan("full", "block", n) for n in range(1, LAYERS)]
    peaks = [none.peak_memory_gib] + [b.peak_memory_gib for b in blocks]
    steps = [none.throughput.step_time_s] + [b.throughput.step_time_s for b in blocks] + [full.throughput.step_time_s]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks  # each recomputed layer frees memory
    # all but one layer, two microbatches: the loss of the second runs beside the gradient accumulators and the one
    # layer left out keeps every activation then, so the peak is that layer's activations (an eighth of what no
    # recompute keeps over recomputing every layer) above recomputing every layer
    one_layer = (none.peak_memory_gib - full.peak_memory_gib) / LAYERS
    assert abs(peaks[-1] - full.peak_memory_gib - one_layer) < 0.05 * one_layer
    assert all(a < b for a, b in zip(steps, steps[1:])), steps  # and costs a forward
    every = _plan("full", "block", LAYERS)
    same = abs(every.peak_memory_gib - full.peak_memory_gib) < 1e-9
    assert same and abs(every.throughput.step_time_s - full.throughput.step_time_s) < 1e-12


def test_keeping_the_attention_kernel_costs_its_tensors_and_saves_its_recompute():
    """full_keep_attention keeps each layer's q, k, v, attention output (bf16) and softmax statistics (fp32) over
    full recompute, and its step drops one attention forward: it lies between full recompute and none."""
    full, kept, none = _plan("full"), _plan("full_keep_attention"), _plan("none")
    shape = _shape(_recipe("full"))
    per_layer = 8192 * (2 * (2 * shape.q_width + 2 * shape.kv_width) + 4 * shape.heads) / 2**30
    extra = kept.stages[0].parts_gib["activations"] - full.stages[0].parts_gib["activations"]
    assert abs(extra - LAYERS * per_layer) < 1e-3  # parts are rounded to MiB
    assert full.peak_memory_gib < kept.peak_memory_gib < none.peak_memory_gib
    assert none.throughput.step_time_s < kept.throughput.step_time_s < full.throughput.step_time_s
