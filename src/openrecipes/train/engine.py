"""The pieces of one training step: the model as the recipe asks for it, the per-token loss, gradients in fp32."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.attention import Documents
from openrecipes.models.common.moe import Routing, SoftmaxTopKRouter, set_expert_backend
from openrecipes.models.common.router_loss import RouterStatistics
from openrecipes.parallel.recompute import apply_recompute
from openrecipes.config.recipe import Recipe


def model_config(recipe: Recipe) -> Any:
    """The model config named by the recipe (registry name or HF directory), with its overrides applied."""
    from openrecipes.models.registry import get_config, names

    if recipe.model in names():
        if recipe.init == "checkpoint":
            raise ValueError(f"init: 'checkpoint' needs model to be a Hugging Face directory, got {recipe.model!r}")
        config = get_config(recipe.model)
    elif Path(recipe.model).is_dir():
        from openrecipes.checkpoint.hf import read_config
        from openrecipes.checkpoint.safetensors_io import HFCheckpoint

        _, config = read_config(HFCheckpoint(recipe.model))
    else:
        raise ValueError(f"model: {recipe.model!r} is neither a registered model ({', '.join(names())}) "
                         "nor a checkpoint directory")
    if recipe.model_overrides:
        known = {f.name for f in dataclasses.fields(config)}
        unknown = sorted(set(recipe.model_overrides) - known)
        if unknown:
            raise ValueError(f"model_overrides: unknown config field(s) {unknown}")
        config = dataclasses.replace(config, **recipe.model_overrides)
    return config


def build_model(recipe: Recipe, device: torch.device, parallel=None) -> nn.Module:
    """The model, on ``device``, with kernels, recompute and (when ``parallel`` spans several ranks) expert and
    data parallelism applied. Parallel runs keep fp32 parameters (the sharded masters) and compute in bf16."""
    from openrecipes.models.families import family_for_config

    config = model_config(recipe)
    distributed = parallel is not None and parallel.distributed
    compute_dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float32
    dtype = parameter_dtype(recipe, distributed)
    pipelined = distributed and parallel.pp_size > 1
    expert_parallel = distributed and parallel.expert_mesh is not None
    if recipe.init == "checkpoint":
        from openrecipes.checkpoint.hf import from_hf

        model = from_hf(recipe.model, dtype=dtype, device=device)
    elif pipelined or expert_parallel:
        # build on the meta device and materialise only what this rank keeps (its stage, its experts)
        model = family_for_config(config).build(config, device="meta", dtype=dtype, seed=None)
    else:
        model = family_for_config(config).build(config, device=device, dtype=dtype, seed=recipe.seed)
    if pipelined:
        _keep_pipeline_stage(model, recipe, config, parallel)
    configure_kernels(model, attention=recipe.kernels.attention, experts=recipe.kernels.experts)
    if recipe.debug.force_load_balance:
        force_load_balance(model)
    layers = decoder_layers(model)
    if expert_parallel:
        from openrecipes.parallel.expert import apply_expert_parallel

        apply_expert_parallel([layer.mlp for layer in layers], parallel.expert_mesh,
                              compute_dtype=compute_dtype if compute_dtype != dtype else None)
    if next(model.parameters()).is_meta:
        model.to_empty(device=device)
        model.init_weights(seed=recipe.seed)  # seeded per parameter name: the whole model's values, sliced
    if distributed and parallel.tp_size > 1:
        from openrecipes.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, layers, parallel.tp_mesh)
    if distributed and parallel.cp_size > 1:
        from openrecipes.parallel.context import apply_context_parallel

        apply_context_parallel(model, parallel.cp_mesh)
    apply_recompute(layers, granularity=recipe.recompute.granularity,
                    method=recipe.recompute.method, num_layers=recipe.recompute.num_layers)
    if distributed and parallel.dense_mesh is not None:
        from openrecipes.parallel.expert import expert_parameters
        from openrecipes.parallel.fsdp import apply_fsdp

        # with ep > 1 the experts are sharded by expert parallelism (and summed over edp by hand); else FSDP
        # shards them with everything else
        ignored = set(expert_parameters(model)) if parallel.expert_mesh is not None else set()
        apply_fsdp(model, layers, parallel.dense_mesh, compute_dtype=compute_dtype, ignored=ignored)
    return model


def parameter_dtype(recipe: Recipe, distributed: bool) -> torch.dtype:
    """How parameters are stored. One process: in the compute dtype. Several processes: fp32 masters sharded by
    FSDP2, except with the precision-aware optimizer, which keeps bf16 parameters (+ int16 remainders) there too."""
    if recipe.precision == "fp32":
        return torch.float32
    if distributed and not recipe.optimizer.precision_aware:
        return torch.float32
    return torch.bfloat16


def fold_sharded_grads(model: nn.Module) -> None:
    """Add each parameter's ``.grad`` (FSDP2 writes bf16 sharded gradients there) into an fp32 ``main_grad`` and
    free it, so several microbatches accumulate in fp32."""
    for param in model.parameters():
        if param.grad is None or param.grad.dtype == torch.float32:
            continue
        main_grad = getattr(param, "main_grad", None)
        if main_grad is None:
            param.main_grad = param.grad.float()
        else:
            main_grad.add_(param.grad)
        param.grad = None


def _keep_pipeline_stage(model: nn.Module, recipe: Recipe, config: Any, parallel) -> None:
    from openrecipes.config.layout import stage_layer_counts
    from openrecipes.parallel.pipeline import prune_to_stage

    counts = stage_layer_counts(recipe.layout, config.num_hidden_layers)
    start = sum(counts[:parallel.pp_rank])
    layers = next(m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, nn.ModuleDict))
    prune_to_stage(model, layers, range(start, start + counts[parallel.pp_rank]), first=parallel.pp_rank == 0,
                   last=parallel.pp_rank == parallel.pp_size - 1)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, in order, whatever the family nests them under (``model.layers`` for Qwen3-MoE,
    ``model.language_model.layers`` for Muse Spark)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleDict):
            return list(module.values())
    raise ValueError(f"{type(model).__name__} has no ModuleDict of decoder layers")


def configure_kernels(model: nn.Module, *, attention: str, experts: str) -> None:
    set_expert_backend(experts)
    for module in model.modules():
        if hasattr(module, "backend") and hasattr(module, "head_dim"):
            module.backend = attention


def force_load_balance(model: nn.Module) -> None:
    """Route token copies round-robin over the experts (every expert gets the same load). The router still runs
    and its gating weights still get gradients; only the expert choice is replaced. For benchmarks only."""
    from openrecipes.models.common.router import SigmoidTopKRouter

    for module in model.modules():
        if isinstance(module, (SoftmaxTopKRouter, SigmoidTopKRouter)):
            original = module.forward
            num_experts = module.weight.shape[0]

            def forward(x_TD, _original=original, _experts=num_experts):
                routing = _original(x_TD)
                tokens, top_k = routing.experts_TK.shape
                balanced = torch.arange(tokens * top_k, device=x_TD.device) % _experts
                return Routing(experts_TK=balanced.view(tokens, top_k), weights_TK=routing.weights_TK)

            module.forward = forward


def loss_weights(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Weight of each next-token target (B, T-1): the loss mask of the target, never across a document start."""
    return batch["loss_mask"][:, 1:] * (batch["position_ids"][:, 1:] != 0)


def microbatch_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], target_slice=None, *,
                        input_slice=None) -> torch.Tensor:
    """Sum of the masked next-token cross entropies of one microbatch (fp32). ``target_slice`` picks this rank's
    part of the targets when the model returns logits for a slice of the sequence (sequence and context
    parallelism); ``input_slice`` cuts the tokens and positions fed to the model (context parallelism: the documents
    stay whole, attention needs the whole row's mask)."""
    documents = Documents(document_ids=batch["document_ids"], cu_seqlens=batch["cu_seqlens"],
                          max_seqlen=int(batch["max_seqlen"]))
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    if input_slice is not None:
        input_ids, position_ids = input_slice(input_ids), input_slice(position_ids)
    logits = model(input_ids, position_ids, documents)
    # every position predicts the next token; the last one's target wraps around and gets weight 0. Not slicing
    # logits[:, :-1] avoids copying the (tokens x vocabulary) tensor.
    targets = torch.roll(batch["input_ids"], -1, dims=1)
    weights = F.pad(loss_weights(batch), (0, 1))
    if target_slice is not None:
        targets, weights = target_slice(targets), target_slice(weights)
    targets, weights = targets.reshape(-1), weights.reshape(-1)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, reduction="none")
    return (per_token * weights).sum()


def check_aux_loss(recipe: Recipe, config: Any, parallel=None) -> None:
    """Refuse a router load-balancing loss (``moe.aux_loss_coef``) the run cannot compute as transformers does,
    and a checkpoint config asking for one the recipe does not match."""
    coef = recipe.moe.aux_loss_coef
    wants = getattr(config, "output_router_logits", False)
    if wants and coef != config.router_aux_loss_coef:
        raise ValueError(f"moe.aux_loss_coef is {coef}, but the model config asks for the router load-balancing loss "
                         f"(output_router_logits=true, router_aux_loss_coef={config.router_aux_loss_coef}): set "
                         "moe.aux_loss_coef to that value, or output_router_logits: false in model_overrides")
    if coef == 0:
        return
    if not hasattr(config, "router_aux_loss_coef"):
        raise ValueError(f"moe.aux_loss_coef={coef}: the load-balancing loss is implemented for softmax routers "
                         f"(Qwen3-MoE), not for {type(config).__name__} (its router balances with an expert bias)")
    # The loss pools every layer's routing over a microbatch's whole sequence before one product: stages holding
    # other layers, or ranks holding other parts of the sequence, would each compute a different function.
    for name, size in (("pp", "pp_size"), ("tp", "tp_size"), ("cp", "cp_size")):
        if parallel is not None and getattr(parallel, size, 1) > 1:
            raise ValueError(f"moe.aux_loss_coef={coef} is not supported with layout.{name}="
                             f"{getattr(parallel, size)}: the load-balancing loss is implemented for data and "
                             "expert parallelism only")


def router_statistics(model: nn.Module, aux_loss_coef: float, batch: dict[str, torch.Tensor]):
    """``with`` it around one microbatch's forward: when the aux loss is on, a ``RouterStatistics`` pooling each row
    on its own (so the loss does not depend on how rows are grouped into microbatches and ranks), else None."""
    if aux_loss_coef == 0:
        return contextlib.nullcontext()
    return RouterStatistics(model, rows=batch["input_ids"].shape[0])


def attach_fp32_grad_accumulators(model: nn.Module) -> None:
    """bf16 parameters fold each backward's gradient into an fp32 ``main_grad`` and free the bf16 one at once,
    so accumulation over microbatches happens in fp32 and only one bf16 gradient lives at a time.

    With a single microbatch per step nothing needs accumulating: ``model.fold_grads = False`` leaves the bf16
    gradient in place (the optimizer upcasts it as it reads), which saves a full pass over the gradients."""
    model.fold_grads = True
    for param in model.parameters():
        if param.dtype == torch.float32 or not param.requires_grad:
            continue
        param.main_grad = None

        def fold(p: torch.Tensor) -> None:
            if not model.fold_grads and p.main_grad is None:
                return
            if p.main_grad is None:
                p.main_grad = p.grad.float()
            else:
                p.main_grad.add_(p.grad)
            p.grad = None

        param.register_post_accumulate_grad_hook(fold)


def gradients(model: nn.Module) -> list[torch.Tensor]:
    """Each parameter's gradient: the fp32 accumulator where one is kept, else ``.grad`` (maybe a DTensor)."""
    out = []
    for param in model.parameters():
        grad = getattr(param, "main_grad", None)
        grad = grad if grad is not None else param.grad
        if grad is not None:
            out.append(grad)
    return out


def zero_gradients(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad = None
        if hasattr(param, "main_grad"):
            param.main_grad = None


def grad_norm_and_clip_scale(grads: list[torch.Tensor], max_norm: float | None, *,
                             stage_group=None) -> tuple[float, float]:
    """Global L2 norm of ``grads`` and the factor that clips it to ``max_norm`` (1.0 when it is within).

    Sharded (DTensor) gradients add their squared local norms over the ranks of the mesh dimension they are
    sharded on. The optimizer applies the factor as it reads each gradient, so clipping costs no extra pass."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        group = None
        if isinstance(grad, DTensor):
            # "not replicated" rather than is_shard(): FSDP2 over TP uses _StridedShard, which is_shard() denies
            group = tuple(grad.device_mesh.get_group(i) for i, placement in enumerate(grad.placements)
                          if not placement.is_replicate())
            grad = grad.to_local()
        groups.setdefault(group, []).append(grad)
    norm_sq = 0.0
    for group, tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        group_sq = torch.stack([n.double() for n in norms]).pow(2).sum()
        for mesh_group in group or ():  # sharded over several mesh dims: sum over each in turn
            torch.distributed.all_reduce(group_sq, group=mesh_group)
        norm_sq += float(group_sq)
    if stage_group is not None:  # pipeline stages hold different layers: add their squares
        device = grads[0].device if grads else torch.device("cpu")
        total = torch.tensor(norm_sq, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(total, group=stage_group)
        norm_sq = float(total)
    norm = norm_sq ** 0.5
    scale = 1.0 if max_norm is None or not norm > max_norm else max_norm / (norm + 1e-6)
    return norm, scale
