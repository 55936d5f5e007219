"""The pieces of one training step: the model as the recipe asks for it, the per-token loss, gradients in fp32."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.config.layout import LayoutProblem
from openrecipes.config.recipe import Recipe
from openrecipes.models.common.attention import Documents
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.router_loss import RouterStatistics
from openrecipes.parallel.compile import dynamic_document_count
from openrecipes.parallel.gradients import GradientSync
from openrecipes.parallel.mesh import ParallelState
from openrecipes.train.chunked_loss import chunked_head
from openrecipes.train.images import image_inputs, sliced_image_inputs, trainable_modules


def build_model(recipe: Recipe, config: Any, parallel: ParallelState) -> tuple[nn.Module, GradientSync]:
    """The model of ``config`` (the recipe's, resolved once by the train entry), on ``parallel.device``, with the recipe's
    kernels, parallelized by ``parallel``'s layout (recompute, and when ``parallel`` spans several ranks pipeline,
    expert, tensor, context and data parallelism); and the object that accumulates and synchronises its gradients.
    Runs whose dense weights FSDP2 shards (dp > 1) keep fp32 parameters (the sharded masters) and compute in bf16
    (``parameter_dtype``); a LoRA run's frozen base stays in the compute dtype (``base_dtype``)."""
    from openrecipes.config.layout import rank_layers
    from openrecipes.models.families import family_for_config
    from openrecipes.parallel.parallelize import ParallelizeOptions, parallelize

    device, distributed = parallel.device, parallel.distributed
    dtype = base_dtype(recipe, parallel)
    kernels = KernelOptions(attention=recipe.kernels.attention, experts=recipe.kernels.experts,
                            balanced_routing=recipe.debug.force_load_balance)
    pipelined = distributed and parallel.pp_size > 1
    if recipe.init == "checkpoint":  # with image rows the complete checkpoint, towers included
        from openrecipes.checkpoint.hf import from_hf, recipe_trains_images

        model = from_hf(recipe.model, dtype=dtype, device=device, kernels=kernels, full=recipe_trains_images(recipe),
                        keep_mtp=recipe.mtp is not None)
    elif pipelined or (distributed and parallel.expert_mesh is not None):
        # build on the meta device; parallelize materialises only what this rank keeps (its stage, its experts)
        model = family_for_config(config).build(config, device="meta", dtype=dtype, seed=None, kernels=kernels)
    else:
        model = family_for_config(config).build(config, device=device, dtype=dtype, seed=recipe.seed, kernels=kernels)
    if recipe.kernels.loss_chunk_tokens:  # before parallelize: data parallelism must see the head it will run
        from openrecipes.train.chunked_loss import install_chunked_loss

        install_chunked_loss(model, family_for_config(config).sharding.lm_head, recipe.kernels.loss_chunk_tokens)
    stage_layers = None
    if pipelined:  # every chunk this rank runs (one without interleaving)
        stage_layers = frozenset(i for _, layers in rank_layers(recipe.layout, config.num_hidden_layers,
                                                               parallel.pp_rank) for i in layers)
    frozen, trained = trainable_modules(recipe, config)
    grads = parallelize(model, parallel, ParallelizeOptions(
        compute_dtype=recipe.compute_dtype(),
        parameter_dtype=parameter_dtype(recipe, parallel),
        seed=recipe.seed, stage_layers=stage_layers, recompute=recipe.recompute, kernels=recipe.kernels,
        lora=lora_spec(recipe) if recipe.lora is not None else None,
        offload_activations=recipe.offload.activations, frozen_modules=frozen, trained_modules=trained,
        fp8=recipe.fp8))
    return model, grads


def lora_spec(recipe: Recipe):
    """The recipe's ``lora`` section as the model-side spec (adapters drawn from the recipe's seed)."""
    from openrecipes.models.common.lora import LoraSpec

    return LoraSpec.from_recipe(recipe)


def check_weights_fit(recipe: Recipe, config: Any, parallel: ParallelState) -> None:
    """Refuse a model whose weights alone cannot fit this rank's memory (an override of a size by mistake, say)
    before trying to allocate them. A lower bound: gradients, optimizer state and activations come on top."""
    device = parallel.device
    bytes_per_param = torch.finfo(base_dtype(recipe, parallel)).bits // 8
    ranks = parallel.world_size  # sharded by the layout at best
    needed = config.total_params() * bytes_per_param / ranks
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).total_memory
    else:
        import os

        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > available:
        raise ValueError(f"model_overrides: {config.total_params():,} parameters need {needed / 2**30:,.1f} GiB of "
                         f"weights per rank before any gradient or optimizer state, more than this "
                         f"{device.type} device's {available / 2**30:,.1f} GiB (`openrecipes plan` estimates the "
                         "whole footprint)")


def fsdp_shards(parallel: ParallelState) -> bool:
    """Whether FSDP2 shards this run's dense weights: several data-parallel ranks (``parallel.dense_mesh``). TP, CP,
    PP and EP without dp leave the weights to their own modules: nothing gathers (and casts) them for compute."""
    return parallel.distributed and parallel.dense_mesh is not None


def parameter_dtype(recipe: Recipe, parallel: ParallelState) -> torch.dtype:
    """How trained parameters are stored. Without FSDP2 (one process, or several with dp = 1): in the compute dtype,
    the optimizer keeping the fp32 masters, since nothing would cast fp32 weights to bf16 for the forward (the dense
    layers would silently compute in fp32 and meet bf16 experts). With FSDP2: fp32 masters it shards and gathers in
    bf16, except with the precision-aware optimizer, which keeps bf16 parameters (+ int16 remainders) there too."""
    if recipe.precision == "fp32":
        return torch.float32
    if fsdp_shards(parallel) and not recipe.optimizer.precision_aware:
        return torch.float32
    return torch.bfloat16


def base_dtype(recipe: Recipe, parallel: ParallelState) -> torch.dtype:
    """How the model's own weights are stored: as trained parameters, except under LoRA, where the base is frozen
    (no gradients, no optimizer state, so no master to keep) and stays in the compute dtype under any layout; only
    the adapters are ``parameter_dtype``'s (fp32 masters under FSDP2). Modules the model pins to fp32 stay fp32
    either way."""
    if recipe.lora is not None:
        return recipe.compute_dtype()
    return parameter_dtype(recipe, parallel)


def loss_weights(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Weight of each next-token target (B, T-1): the loss mask of the target, never across a document start."""
    return batch["loss_mask"][:, 1:] * (batch["position_ids"][:, 1:] != 0)


def microbatch_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], target_slice=None, *,
                        input_slice=None, loss_fn=None, whole_rows: bool = False, mtp=None) -> torch.Tensor:
    """Sum of the masked next-token cross entropies of one microbatch (fp32). ``target_slice`` picks this rank's
    part of the targets when the model returns logits for a slice of the sequence (sequence and context
    parallelism); ``input_slice`` cuts the tokens and positions fed to the model (context parallelism: the documents
    stay whole, attention needs the whole row's mask). ``loss_fn``: ``token_loss_sum`` or ``loss_function``'s.
    ``whole_rows``: every row of the data is one document, so attention is plain causal attention. Decided for the
    whole data, not per microbatch, so that a compiled block never sees both cases. ``mtp``: the step's
    ``train.mtp_loss.MtpObjective``; the forward then also runs the MTP layers and the microbatch's MTP term is left
    in it."""
    documents = None if whole_rows else dynamic_document_count(Documents(
        document_ids=batch["document_ids"], cu_seqlens=batch["cu_seqlens"], max_seqlen=int(batch["max_seqlen"])))
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    images = image_inputs(batch)
    if input_slice is not None and images:  # image positions come from the whole rows, before the cut
        position_ids, images = sliced_image_inputs(model, batch, input_slice)
        input_ids = input_slice(input_ids)
    elif input_slice is not None:
        input_ids, position_ids = input_slice(input_ids), input_slice(position_ids)
    # every position predicts the next token; the last one's target wraps around and gets weight 0. Not slicing
    # logits[:, :-1] avoids copying the (tokens x vocabulary) tensor.
    targets = torch.roll(batch["input_ids"], -1, dims=1)
    weights = F.pad(loss_weights(batch), (0, 1))
    if target_slice is not None:
        targets, weights = target_slice(targets), target_slice(weights)
    head = chunked_head(model)
    extra = {"mtp": True} if mtp is not None else {}
    if head is not None:  # the head returns the loss sum itself (kernels.loss_chunk_tokens)
        with head.targets(targets, weights):
            out = model(input_ids, position_ids, documents, **extra)
    else:
        out = model(input_ids, position_ids, documents, **images, **extra)
    if mtp is not None:
        out, hidden = out
        mtp.add(hidden, batch, head_loss(model, loss_fn))
    return out if head is not None else (loss_fn or token_loss_sum)(out, targets, weights)


def head_loss(model: nn.Module, loss_fn=None):
    """Σ weight · cross entropy of the model's LM head on other hidden states (the MTP depths'), computed as the main
    loss is: chunked with the chunked head (``kernels.loss_chunk_tokens``), else ``loss_fn`` on the head's logits."""
    from openrecipes.models.families import family_for_model
    from openrecipes.train.chunked_loss import linear_cross_entropy

    chunked = chunked_head(model)
    if chunked is not None:
        return lambda h, targets, weights: linear_cross_entropy(h, chunked.weight, targets, weights,
                                                                chunk=chunked.chunk, softcap=chunked.softcap)
    lm_head = model.get_submodule(family_for_model(model).sharding.lm_head)
    return lambda h, targets, weights: (loss_fn or token_loss_sum)(lm_head(h), targets, weights)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ weight · cross entropy over the tokens, in fp32: the one loss of the plain and the pipelined step."""
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none")
    return (per_token * weights.reshape(-1).to(per_token.dtype)).sum()


def loss_function(compiled: bool):
    """``token_loss_sum``, or with ``kernels.compile`` its compiled form: the fp32 cast, log-softmax and weighted sum
    fused into passes that read the bf16 logits without writing an fp32 copy of them."""
    return _compiled_token_loss_sum() if compiled else token_loss_sum


@functools.cache
def _compiled_token_loss_sum():
    return torch.compile(token_loss_sum)


def layout_problems_for(recipe: Recipe, config: Any, *, world_size: int, rows: Path) -> list[LayoutProblem]:
    """The layout rules (config/layout.py ``layout_problems``) on the recipe's run over ``world_size`` processes:
    the model's sizes, and the rows built at ``rows`` (or, before they are built, those its ``data.build`` makes)."""
    from openrecipes.config.layout import layout_problems
    from openrecipes.data.manifest import MANIFEST_FILE, read_manifest
    from openrecipes.plan.host import recipe_workload
    from openrecipes.plan.shape import model_shape

    build = recipe.data.build
    if build is not None and not (rows / MANIFEST_FILE).is_file():
        row_tokens, image_rows = build.row_tokens, build.image_processor is not None
    else:
        manifest = read_manifest(rows)
        row_tokens, image_rows = int(manifest["row_tokens"]), bool(manifest.get("images"))
    workload = recipe_workload(recipe, config, row_tokens=row_tokens, image_rows=image_rows)
    return layout_problems(recipe.layout, world_size=world_size, model=model_shape(config).layout_model(),
                           workload=workload)


def check_aux_loss(recipe: Recipe, config: Any) -> None:
    """Refuse a router load-balancing loss (``moe.aux_loss_coef``) the run cannot compute as transformers does (a
    family that does not declare it: ``ModelFamily.aux_loss``), and a checkpoint config asking for one the recipe
    does not match. The layouts it runs with are the layout rules' (``layout_problems_for``)."""
    from openrecipes.models.families import family_for_config

    coef = recipe.moe.aux_loss_coef
    declared = family_for_config(config).aux_loss
    if declared is not None and declared.requested(config) and coef != declared.coefficient(config):
        raise ValueError(f"moe.aux_loss_coef is {coef}, but the model config asks for the router load-balancing loss "
                         f"({declared.request_key}=true, {declared.coefficient_key}={declared.coefficient(config)}): "
                         f"set moe.aux_loss_coef to that value, or {declared.request_key}: false in model_overrides")
    if coef != 0 and declared is None:
        raise ValueError(f"moe.aux_loss_coef={coef}: the load-balancing loss is implemented for softmax routers "
                         f"(Qwen3-MoE), not for {type(config).__name__} (its router balances with an expert bias)")


def check_mtp(recipe: Recipe, config: Any) -> None:
    """Refuse a recipe ``mtp`` the run cannot train: a model without multi-token-prediction layers, or LoRA (a frozen
    base). The layouts it trains with are the layout rules' (``layout_problems_for``)."""
    if recipe.mtp is None:
        return
    from openrecipes.models.families import family_for_config

    declared = family_for_config(config).mtp
    if declared is None or declared.held(config) == 0:
        raise ValueError(f"mtp: the model {recipe.model!r} has no multi-token-prediction layers to train (a "
                         "DeepSeek-V3 config declares them: num_nextn_predict_layers, settable in model_overrides)")
    if recipe.init == "checkpoint":
        from openrecipes.checkpoint.hf import holds_mtp_tensors
        from openrecipes.checkpoint.safetensors_io import HFCheckpoint

        if not holds_mtp_tensors(HFCheckpoint(recipe.model), family_for_config(config), config):
            raise ValueError(f"mtp: {recipe.model} declares {declared.held(config)} multi-token-prediction layer(s) "
                             "(num_nextn_predict_layers) but holds none of their tensors (transformers saves none): "
                             "start from a checkpoint that has them, or train without mtp")
    if recipe.lora is not None:
        raise ValueError("mtp: not with lora (the base, MTP layers included, is frozen under LoRA)")


def mtp_objective(recipe: Recipe, model: nn.Module, microbatches: list, device: torch.device,
                  parallel: ParallelState):
    """The step's ``train.mtp_loss.MtpObjective`` when the recipe trains MTP (``mtp``), else None; its target counts
    over the data-parallel ranks' rows, as the main loss's."""
    if recipe.mtp is None:
        return None
    from openrecipes.models.families import family_for_model
    from openrecipes.train.mtp_loss import MtpObjective

    depths = family_for_model(model).mtp.held(model.config)
    group = parallel.dense_mesh.get_group() if parallel.dense_mesh is not None else None
    return MtpObjective(recipe.mtp.loss_weight, depths, microbatches, device, group)


def router_statistics(model: nn.Module, aux_loss_coef: float, batch: dict[str, torch.Tensor]):
    """``with`` it around one microbatch's forward: when the aux loss is on, a ``RouterStatistics`` pooling each row
    on its own (so the loss does not depend on how rows are grouped into microbatches and ranks), else None."""
    if aux_loss_coef == 0:
        return contextlib.nullcontext()
    return RouterStatistics(model, rows=batch["input_ids"].shape[0])


class StageLoss:
    """The pipeline's last stage: the per-token loss of one microbatch. ``target`` packs (next-token id, weight) in
    its last dimension; ``supervised_tokens`` (the global batch's count) is set before each step. Under sequence
    parallelism the logits cover this rank's slice of the sequence, and ``sequence_slice`` cuts the targets to
    match."""

    def __init__(self, sequence_slice=None, *, head_computes_loss: bool = False) -> None:
        self.supervised_tokens = 1.0
        self.sequence_slice = sequence_slice
        self.head_computes_loss = head_computes_loss

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.head_computes_loss:  # the stage's output is already the loss sum (``stage_loss_inputs``)
            return logits.sum() / self.supervised_tokens
        if self.sequence_slice is not None:
            target = self.sequence_slice(target)
        return token_loss_sum(logits, target[..., 0].long(), target[..., 1]) / self.supervised_tokens

    def loss_inputs(self, model: nn.Module):
        """For the pipeline's last stage with a chunked loss head: a function of one microbatch's packed target
        returning the ``with`` block its forward runs in (the head reads its targets there); else None."""
        head = chunked_head(model)
        if not self.head_computes_loss or head is None:
            return None

        def inputs(target: torch.Tensor):
            if self.sequence_slice is not None:
                target = self.sequence_slice(target)
            return head.targets(target[..., 0].long(), target[..., 1])
        return inputs
