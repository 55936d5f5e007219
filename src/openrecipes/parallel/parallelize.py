"""Apply a layout to a built model, in one fixed order, and hand back what the step needs to synchronise gradients.

The order (each step relies on the ones before it):
1. pipeline stage pruning: drop the layers, embedding and head this stage does not run (and an image model's
   towers and projection on every stage but the first);
2. expert parallelism: each rank keeps its experts and dispatches tokens to the others (all-to-all);
3. materialisation: a model built on the meta device gets storage and its seeded values, sliced per rank;
   then LoRA adapters (the recipe's ``lora``) on what this rank holds, expert adapters sliced with their experts;
   then an image model's towers frozen and its projection trained or frozen (``frozen_modules``, ``trained_modules``);
   then the recipe's FP8 products (``fp8``: parallel/fp8.py) in the decoder layers;
4. tensor + sequence parallelism: the attention projections split by heads, the residual stream by sequence;
5. context parallelism: attention reads the whole row's keys and values from the cp group;
6. activation recompute, then activation offload around it;
7. torch.compile of the attention and MoE blocks below the recompute boundary (``kernels.compile``);
8. FSDP2 over the data-parallel ranks (dense weights; experts are left to expert parallelism).

The model is pure PyTorch and declares its parts through its family's sharding plan
(``openrecipes.models.families.ShardingPlan``); nothing here looks for attributes by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from openrecipes.config.recipe import Fp8, Kernels, Recompute
from openrecipes.models.common.lora import LoraSpec
from openrecipes.parallel.gradients import GradientSync
from openrecipes.parallel.mesh import ParallelState
from openrecipes.parallel.recompute import RecomputedAttentionCore, apply_recompute


@dataclass(frozen=True, kw_only=True)
class ParallelizeOptions:
    compute_dtype: torch.dtype
    parameter_dtype: torch.dtype            # of the trained parameters (with lora: the adapters; the base is as built)
    seed: int                               # values of a meta-built model: seeded per tensor name
    stage_layers: Collection[int] | None = None  # this rank's pipeline chunks' decoder layers (None: all)
    recompute: Recompute = field(default_factory=Recompute)  # the recipe's section, as it is
    kernels: Kernels = field(default_factory=Kernels)        # the recipe's section: its compile is applied here
    lora: LoraSpec | None = None            # adapters to train on a frozen base
    offload_activations: bool = False       # decoder layers' saved tensors wait in host memory
    fp8: Fp8 | None = None                  # the recipe's section: which products run in FP8
    # module paths whose parameters never train (an image model's towers) and ones that do even on a LoRA-frozen base
    # (its projection, when the recipe trains it); applied after LoRA, before the layouts read requires_grad
    frozen_modules: tuple[str, ...] = ()
    trained_modules: tuple[str, ...] = ()


def _adapt(model: nn.Module, plan, layers: list[nn.Module], parallel: ParallelState,
           options: ParallelizeOptions) -> None:
    """Step 3's second half, on the materialised weights: LoRA adapters, what trains, the FP8 products."""
    if options.lora is not None:
        # after materialising: the base keeps its own names and values; the adapters draw theirs by name
        from openrecipes.models.common.lora import apply_lora

        apply_lora(model, options.lora, dtype=options.parameter_dtype)
        if parallel.distributed and parallel.expert_mesh is not None:
            from openrecipes.parallel.expert import shard_expert_adapters

            shard_expert_adapters(plan.moe_blocks(layers), parallel.expert_mesh)
    set_trainable(model, frozen=options.frozen_modules, trained=options.trained_modules)
    if options.fp8 is not None:  # before TP, recompute, compile and FSDP2 wrap the modules it changes
        from openrecipes.parallel.fp8 import apply_fp8

        apply_fp8(layers, plan, options.fp8.targets)


def parallelize(model: nn.Module, parallel: ParallelState, options: ParallelizeOptions) -> GradientSync:
    """Apply ``parallel``'s layout to ``model`` in place (see the module docstring for the order)."""
    from openrecipes.models.families import family_for_model

    plan = family_for_model(model).sharding
    distributed = parallel.distributed
    if distributed and parallel.pp_size > 1:
        from openrecipes.parallel.pipeline import prune_to_stage

        prune_to_stage(model, plan, options.stage_layers, first=parallel.pp_rank == 0,
                       last=parallel.pp_rank == parallel.pp_size - 1)
        images = family_for_model(model).images
        held = images.modules(model.config) if images is not None else None
        if held is not None and parallel.pp_rank != 0:  # an image model's encoders run on the first stage only
            for path in held[0] + held[1]:
                plan.drop(model, path)
    layers = plan.decoder_layers(model)
    if distributed and parallel.expert_mesh is not None:
        from openrecipes.parallel.expert import apply_expert_parallel

        mixed = options.compute_dtype if options.compute_dtype != options.parameter_dtype else None
        apply_expert_parallel(plan.moe_blocks(layers), parallel.expert_mesh,
                              expert_weights=plan.experts, compute_dtype=mixed)
    if next(model.parameters()).is_meta:
        from openrecipes.parallel.init import fill_sharded_seeded_normal_

        model.to_empty(device=parallel.device)
        model.init_weights(seed=options.seed, fill=fill_sharded_seeded_normal_)  # the whole model's values, sliced
    _adapt(model, plan, layers, parallel, options)
    tp_sharded: frozenset[str] = frozenset()
    if distributed and parallel.tp_size > 1:
        from openrecipes.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, plan, layers, parallel.tp_mesh)
        # by name: FSDP later replaces the parameter objects (and Python may hand their old ids to new objects)
        tp_sharded = frozenset(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    if distributed and parallel.cp_size > 1:
        from openrecipes.parallel.context import apply_context_parallel

        apply_context_parallel(model, plan, layers, parallel.cp_mesh)
    recompute = options.recompute
    recomputed = apply_recompute(layers, granularity=recompute.granularity, method=recompute.method,
                                 num_layers=recompute.num_layers, attention_of=plan.attention_of,
                                 experts_of=plan.experts_of)
    if options.offload_activations:  # after recompute: its hooks go around the checkpoint's
        from openrecipes.parallel.activation_offload import apply_activation_offload

        apply_activation_offload(layers)
    if options.kernels.compile:
        from openrecipes.parallel.compile import apply_compile, inputs_require_grad

        blocks = [block for layer in layers for block in (plan.attention_of(layer), plan.feed_forward_of(layer))]
        # a block holding a recomputed part (the experts, the attention core) stays eager like a recomputed block
        eager = recomputed + [block for block in blocks if any(m in recomputed for m in block.modules())
                              or isinstance(getattr(block, "backend", None), RecomputedAttentionCore)]
        apply_compile(blocks, recomputed=eager)
        embedding = plan.part(model, plan.embedding)
        if embedding is not None and not any(p.requires_grad for p in embedding.parameters()):
            inputs_require_grad(embedding)
    if distributed and parallel.dense_mesh is not None:
        from openrecipes.parallel.expert import expert_parameters
        from openrecipes.parallel.fsdp import apply_fsdp

        # with ep > 1 the experts are sharded by expert parallelism (and summed over edp by hand); else FSDP
        # shards them with everything else
        ignored = set(expert_parameters(model)) if parallel.expert_mesh is not None else set()
        apply_fsdp(model, layers, parallel.dense_mesh, compute_dtype=options.compute_dtype, ignored=ignored)
    return GradientSync(model, parallel, tp_sharded_names=tp_sharded,
                        fp32_accumulation=options.parameter_dtype == torch.bfloat16)


def set_trainable(model: nn.Module, *, frozen: tuple[str, ...], trained: tuple[str, ...]) -> None:
    """``requires_grad`` False for every parameter under a ``frozen`` module path, True under a ``trained`` one (a
    path that names no module of the model is an error: a family declaring a wrong path would train its tower; one a
    pipeline stage dropped is skipped)."""
    for paths, value in ((frozen, False), (trained, True)):
        for path in paths:
            parent, _, name = path.rpartition(".")
            module = getattr(model.get_submodule(parent) if parent else model, name)  # AttributeError names it
            for param in module.parameters() if module is not None else ():
                param.requires_grad_(value)
