"""One rank of a multi-GPU layout, measured alone: this process joins a fake process group as rank r of N (its
collectives return at once with outputs of the right shape and meaningless values), builds exactly what rank r
builds in the real job (its pipeline stage, its experts, its tensor-parallel slices, its FSDP shards, recompute,
optimizer offload) with the engine's own ``build_model`` and runs the engine's own ``train_step`` a few times, each
phase timed apart. Memory is that rank's; times are its compute without communication.

Where a value received from another rank decides a shape or a branch, the measurement assumes (docs/plan.md,
"One rank measured alone"):
- expert parallelism: every rank of the expert group routes as this rank does (``assume_mirrored_routing``): exact
  under balanced routing, which the measurement therefore turns on (``debug.force_load_balance``);
- the data-parallel sums (supervised tokens, loss, gradient norm) and the peaks come back as this rank's own: the
  loss is normalised by this rank's supervised tokens, a constant factor that changes no shape and no time, and
  every value stays finite so no step is skipped;
- pipeline parallelism: the neighbouring stages send tensors of the shapes the real stages exchange, with finite
  made-up values (``stage_shapes``, parallel/lone_stage.py); torch's schedule runs this rank's stages unchanged.

Run as ``python -m openrecipes.train.rank_measure RECIPE --rank R --world N --out FILE`` (one process per rank, so
each peak is that rank's); ``openrecipes measure-rank`` starts these and compares them with the planner.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from openrecipes.config.recipe import Recipe

if TYPE_CHECKING:
    from openrecipes.parallel.lone_stage import StageShapes

GradientReport = Callable[[int, dict[str, torch.Tensor]], None]


def measured_recipe(recipe: Recipe) -> Recipe:
    """The recipe as one rank measures it: balanced routing, the assumption under which the mirrored expert counts
    equal what the real all-to-all delivers; no checkpoints or exports written."""
    debug = recipe.debug.model_copy(update={"force_load_balance": True})
    checkpoint = recipe.checkpoint.model_copy(update={"every": None, "at_end": False, "export_hf": False})
    return recipe.model_copy(update={"debug": debug, "checkpoint": checkpoint})


def join_fake_world(rank: int, world: int) -> None:
    """This process as rank ``rank`` of ``world`` under PyTorch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def local_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Elements this rank holds: dense (its FSDP shard, its TP slice) and expert (its experts, its FFN slice)."""
    from openrecipes.parallel.expert import expert_parameters

    def local(p: torch.Tensor) -> int:
        return (p.to_local() if hasattr(p, "to_local") else p).numel()

    experts = {id(p) for p in expert_parameters(model)}
    counts = {"dense": 0, "experts": 0}
    for p in model.parameters():
        counts["experts" if id(p) in experts else "dense"] += local(p)
    return counts


def measure_rank(recipe: Recipe, config: Any, *, rank: int, world: int, steps: int,
                 device: torch.device | None = None, join: Callable[[int, int], None] = join_fake_world,
                 alone: bool = True, on_gradients: GradientReport | None = None) -> dict[str, Any]:
    """Build rank ``rank`` of ``world`` and run ``steps`` timed steps; the first is a warm-up left out of the
    times. Returns the figures (``openrecipes measure-rank``'s per-rank record).

    ``join`` makes this process rank ``rank`` of ``world`` (by default under the fake process group). ``alone``:
    the rank makes the assumptions of the module's docstring (mirrored routing, its pipeline's neighbours given);
    false, it runs as one rank of a real world (tests/distributed/test_rank_replay.py runs it so to compare with).
    ``on_gradients``: called at each step with the step's index and the gradients of this rank's shards as the
    optimizer reads them (``local_gradients``)."""
    from openrecipes.parallel.expert import assume_mirrored_routing
    from openrecipes.parallel import mesh  # by module: the allocator call is looked up when made
    from openrecipes.parallel.pipeline import run_alone
    from openrecipes.train import engine
    from openrecipes.train.loop import _optimizer, _pipeline, _row_loader, train_step
    from openrecipes.train.stage_memory import build_peak_and_reset, rank_peak_bytes

    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    # the real job's allocator (kernels.allocator), set before the first allocation as train/loop.py sets it: the
    # reserved peak and what fits depend on it
    mesh.use_cuda_allocator(recipe.kernels.allocator)
    join(rank, world)
    try:
        parallel = mesh.build_parallel_state(recipe.layout, device)
        torch.manual_seed(recipe.seed)
        loader = _row_loader(recipe, config, Path(recipe.run_dir), parallel, rank=rank, world=world)
        model, grads = engine.build_model(recipe, config, parallel)
        dispatchers = assume_mirrored_routing(model) if alone else []
        if on_gradients is not None:
            _report_gradients(grads, model, on_gradients)
        optimizer = _optimizer(recipe, model, parallel)
        pipeline = _pipeline(recipe, config, model, parallel, device, loader.rows_per_microbatch)
        if pipeline is not None and alone:
            pipeline = run_alone(pipeline, stage_shapes(recipe, config, parallel, loader), seed=recipe.seed)
        build_peak_and_reset(device)
        records = [train_step(model, optimizer, loader, recipe, step, device, grads, parallel, pipeline, timed=True)
                   for step in range(steps)]
    finally:
        dist.destroy_process_group()
    _check_finite(records)
    timed = records[1:] or records  # the first step compiles and allocates
    phases = _phase_seconds([r["phase_times_s"] for r in timed])
    result = {"rank": rank, "world_size": world, "device": str(device), "pp_rank": parallel.pp_rank,
              "dp_rank": parallel.dp_rank, "steps": steps, "timed_steps": len(timed),
              "parameters": local_parameters(model), "microbatches": len(loader.microbatches(0)),
              "rows_per_microbatch": loader.rows_per_microbatch, "row_tokens": loader.dataset.row_tokens,
              "phases_s": phases, "loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
              "expert_rows_received": [d.received_rows[-1] for d in dispatchers if d.received_rows]}
    if pipeline is not None and alone:  # torch's own stages count nothing
        result["pipeline"] = pipeline_counts(pipeline, steps)
    if device.type == "cuda":
        result["peak_allocated_gib"] = max(r["peak_memory_gib"] for r in records)
        result["peak_reserved_gib"] = max(r["peak_reserved_gib"] for r in records)
    else:  # the CPU allocator leaves no peak to read but the process's resident one (interpreter included)
        result["peak_rss_gib"] = rank_peak_bytes(device, None) / 2**30
    return result


def local_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each parameter's gradient as this rank holds it (the fp32 accumulator where one is kept; a
    sharded one's local shard), by parameter name."""
    found = {name: p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
             for name, p in model.named_parameters()}
    return {name: (g.to_local() if hasattr(g, "to_local") else g).detach().clone()
            for name, g in found.items() if g is not None}


def _report_gradients(grads: Any, model: torch.nn.Module, report: GradientReport) -> None:
    """Have ``grads`` hand each step's gradients to ``report`` before it clears them: the step's last moment that
    holds them, after their sums over the groups and the optimizer's read."""
    zero, steps = grads.zero, itertools.count()

    def reported_then_zeroed() -> None:
        report(next(steps), local_gradients(model))
        zero()

    grads.zero = reported_then_zeroed


def stage_shapes(recipe: Recipe, config: Any, parallel: Any, loader: Any) -> StageShapes:
    """What this rank's pipeline stages would receive from their neighbours for one microbatch: the token ids as the
    first stage takes them (its context-parallel slice of the rows) and the hidden states of the residual stream
    (its context- and sequence-parallel slice, in the compute dtype)."""
    from openrecipes.parallel.lone_stage import StageShapes
    from openrecipes.plan.shape import model_shape
    from openrecipes.train.loop import _sequence_slices

    rows = torch.empty(loader.rows_per_microbatch, loader.dataset.row_tokens, device="meta")
    context, local = (s or (lambda t: t) for s in _sequence_slices(parallel))
    hidden = model_shape(config, name=recipe.model).hidden
    # the dtype engine.build_model computes in; a stage's output is checked against it at every microbatch
    dtype = recipe.compute_dtype()
    return StageShapes(token_ids=tuple(context(rows).shape), hidden=(*local(rows).shape, hidden), dtype=dtype)


def pipeline_counts(pipeline: Any, steps: int) -> dict[str, Any]:
    """Per step, what this rank's stages ran: microbatch forwards and backwards, and per stage the most microbatches
    it held forwarded and not yet backwarded (whose activations it keeps)."""
    return {"stages": [stage.stage_index for stage in pipeline.stages], "microbatches": pipeline.microbatches,
            "forwards_per_step": sum(stage.forwards for stage in pipeline.stages) / steps,
            "backwards_per_step": sum(stage.backwards for stage in pipeline.stages) / steps,
            "most_in_flight": [stage.most_in_flight for stage in pipeline.stages]}


def _check_finite(records: list[dict[str, Any]]) -> None:
    """A non-finite loss or norm makes the optimizer skip its update, and the step timed would not be the real one:
    refuse the measurement rather than report it."""
    import math

    for r in records:
        if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])):
            raise ValueError(f"step {r['step']}: loss {r['loss']}, gradient norm {r['grad_norm']}: a value this rank "
                             "received under the fake process group made the step non-finite, so its optimizer "
                             "update was skipped and the times would not be the real step's")


def _phase_seconds(times: list[dict[str, float]]) -> dict[str, float]:
    """The median over the steps of forward, backward (each the sum over the step's microbatches; a pipeline's
    interleaved forward_backward apart), gradient sync and norm, and optimizer."""
    def kind(phase: str) -> str:
        return phase.rsplit("_", 1)[0] if phase.rsplit("_", 1)[-1].isdigit() else phase

    per_step = []
    for step in times:
        sums: dict[str, float] = {}
        for phase, seconds in step.items():
            sums[kind(phase)] = sums.get(kind(phase), 0.0) + seconds
        per_step.append(sums)
    return {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}


def main(argv: list[str] | None = None) -> int:
    from openrecipes.checkpoint.hf import recipe_model_config
    from openrecipes.config.layout import with_world_size
    from openrecipes.config.recipe import load_recipe

    parser = argparse.ArgumentParser(prog="python -m openrecipes.train.rank_measure", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="JSON file the rank's figures are written to")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    recipe = measured_recipe(recipe.model_copy(update={"layout": with_world_size(recipe.layout, args.world)}))
    result = measure_rank(recipe, recipe_model_config(recipe), rank=args.rank, world=args.world, steps=args.steps)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
