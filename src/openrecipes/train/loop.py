"""The training loop: data, model, optimizer, per-token loss over the global batch, metrics, checkpoints, resume."""

from __future__ import annotations

import gc
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam
from openrecipes.optim.schedule import lr_at
from openrecipes.models.common.precision import check_fp32_parameters
from openrecipes.parallel.gradients import GradientSync, clip_scale, grad_norm_squared
from openrecipes.parallel.mesh import ParallelState
from openrecipes.train import engine
from openrecipes.train.exports import adapter_base, export_hf, exports_base
from openrecipes.train.banner import cpu_precision_note
from openrecipes.train.heartbeat import Heartbeat
from openrecipes.train.images import check_rows_directory, pipeline_image_inputs
from openrecipes.train.rows_vocabulary import check_rows_vocabulary
from openrecipes.checkpoint.training_save import latest_checkpoint, remove_stale_staging, save_checkpoint
from openrecipes.train.metrics import MetricsStream
from openrecipes.train.stage_memory import MemoryTrace, build_peak_and_reset, peak_gib_per_stage, rank_peak_bytes
from openrecipes.train.resume import resumed_changes
from openrecipes.config.recipe import Recipe
from openrecipes.config.rundir import (ADAPTER_DIR, BASE_EXPORT_DIR, METRICS_FILE, PEAK_MEMORY_PER_STAGE,
                                       rows_directory)
from openrecipes.data.manifest import MANIFEST_FILE
from openrecipes.train.profiling import profiled_step
from openrecipes.train.run_start import finished, never_saved, record_fresh_start, resumed_step, run_info


class TrainingStopped(ValueError):
    """The run stopped on purpose (a non-finite loss or gradient norm); the message says where."""


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(value: torch.Tensor, op=None) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(value, op=op or dist.ReduceOp.SUM)
    return value


def _rows_to_train_on(recipe: Recipe, run_dir: Path) -> Path:
    rows = rows_directory(recipe.data.rows, run_dir)
    if not (rows / MANIFEST_FILE).is_file():
        raise FileNotFoundError(f"{rows / MANIFEST_FILE} not found: build the rows first (`openrecipes train` builds "
                                "data.build's rows before it starts the workers; see openrecipes.data.build_recipe_rows)")
    return rows


@dataclass(kw_only=True)
class _Trainee:
    """What each step trains with."""
    model: Any
    optimizer: MixedPrecisionAdam
    loader: Any
    grads: Any
    parallel: ParallelState
    pipeline: Any
    device: torch.device

    def step(self, recipe: Recipe, step: int) -> dict:
        return train_step(self.model, self.optimizer, self.loader, recipe, step, self.device, self.grads,
                          self.parallel, self.pipeline)


def train(recipe: Recipe, *, command: str, resume: bool = False, stop_after: int | None = None,
          device: torch.device | None = None, config: Any = None) -> Path:
    """Run (or resume) the recipe; returns the run directory. ``config``: the recipe's model config when the caller
    resolved it already (``checkpoint.hf.recipe_model_config``, what `openrecipes train` does once per process)."""
    from openrecipes.parallel.mesh import build_parallel_state, init_distributed, use_cuda_allocator
    from openrecipes.train.startup import StartupClock

    clock = StartupClock()
    use_cuda_allocator(recipe.kernels.allocator)  # before the first allocation: segments are mapped as they grow
    rank, world, default_device = init_distributed(recipe.distributed_timeout_minutes)
    device = device or default_device
    run_dir = Path(recipe.run_dir)
    config = recipe_model_config(recipe) if config is None else config
    parallel = build_parallel_state(_checked_layout(recipe, config, world, run_dir), device)
    engine.check_aux_loss(recipe, config)
    engine.check_mtp(recipe, config)
    if not resume and (run_dir / METRICS_FILE).exists() and not never_saved(run_dir):
        raise ValueError(f"run_dir: {run_dir} already holds a run; resume it with --resume or choose another run_dir")
    resume_changes = resumed_changes(run_dir, recipe) if resume else {}
    if resume and finished(run_dir, recipe.steps):
        if rank == 0:
            print(f"openrecipes train: {run_dir} is finished: its last save is step {recipe.steps - 1} of its "
                  f"{recipe.steps} steps, so there is nothing to resume (--set steps=N trains further)",
                  file=sys.stderr)
        return run_dir
    if rank == 0:  # `openrecipes train` claimed it already; a direct call is held to the same rule
        from openrecipes.train.run_inputs import claim_recipe_run_dir

        claim_recipe_run_dir(recipe, None)
    if world > 1 and dist.is_initialized():  # no rank writes into the run directory before it is claimed
        dist.barrier()
    torch.manual_seed(recipe.seed)

    loader = _row_loader(recipe, config, run_dir, parallel, rank=rank, world=world)
    note = cpu_precision_note(recipe, device.type) if rank == 0 else None
    if note:
        print(note, file=sys.stderr, flush=True)
    row_tokens, rows_per_microbatch = loader.dataset.row_tokens, loader.rows_per_microbatch

    clock.mark("setup")
    engine.check_weights_fit(recipe, config, parallel)
    model, grads = engine.build_model(recipe, config, parallel)
    clock.mark("build")
    check_fp32_parameters(model)  # fp32-pinned tensors loaded in bf16 fail here, before any step
    optimizer = _optimizer(recipe, model, parallel)
    clock.mark("optimizer")
    trainee = _Trainee(model=model, optimizer=optimizer, loader=loader, grads=grads, parallel=parallel, device=device,
                       pipeline=_pipeline(recipe, config, model, parallel, device, rows_per_microbatch))
    if rank == 0:
        remove_stale_staging(run_dir)  # a save cut short by a kill: written by this tool, never complete
    if resume:
        start = resumed_step(run_dir, recipe, model, optimizer, resume_changes, rank)
    else:
        start = 0
        if rank == 0:
            record_fresh_start(run_dir, recipe, run_info(recipe, config, device, command, world, row_tokens,
                                                         rows_per_microbatch))
    last = recipe.steps - 1 if stop_after is None else min(stop_after, recipe.steps - 1)
    _train_steps(recipe, trainee, run_dir, start=start, last=last, stop_after=stop_after, rank=rank, world=world,
                 clock=clock)
    if recipe.checkpoint.export_hf and last == recipe.steps - 1 and rank == 0:
        export_hf(run_dir)
    if exports_base(recipe) and last == recipe.steps - 1 and rank == 0:
        export_hf(run_dir, BASE_EXPORT_DIR, lora="base")
    return run_dir


def _checked_layout(recipe: Recipe, config: Any, world: int, run_dir: Path):
    """The recipe's layout, refused with its first problem for this world size and these rows."""
    from openrecipes.config.layout import LayoutError

    problems = engine.layout_problems_for(recipe, config, world_size=world,
                                          rows=rows_directory(recipe.data.rows, run_dir))
    if problems:
        raise LayoutError(problems[0])
    return recipe.layout


def _train_steps(recipe: Recipe, trainee: _Trainee, run_dir: Path, *, start: int, last: int,
                 stop_after: int | None, rank: int, world: int, clock: Any) -> None:
    """Steps ``start`` to ``last``: each step's metrics, the saves the recipe asks for, the adapter at the end."""
    metrics = MetricsStream(run_dir, total_steps=recipe.steps, progress=recipe.logging.progress,
                            tensorboard=recipe.logging.tensorboard, wandb=recipe.logging.wandb,
                            wandb_project=recipe.logging.wandb_project, run_name=recipe.name, enabled=rank == 0)
    debug = recipe.debug
    build_peak = build_peak_and_reset(trainee.device)
    gc.disable()  # a collection pause in the middle of a step shows up as a slow step; collect between steps
    skipped_in_a_row = 0  # with debug.skip_nonfinite_steps: a run that stays non-finite stops instead of idling on
    # only where other ranks would wait for a stalled one (heartbeat.py)
    heartbeat = Heartbeat(rank=rank, timeout_s=recipe.heartbeat_timeout_seconds, enabled=world > 1)
    try:
        for step in range(start, last + 1):
            heartbeat.step_begins()
            if debug.fail_at == (rank, step):
                raise RuntimeError(f"injected failure on rank {rank} at step {step} (debug.fail_at)")
            if step == debug.profile_step:
                record = profiled_step(run_dir, debug, rank, lambda: trainee.step(recipe, step))
            else:
                record = trainee.step(recipe, step)
            heartbeat.step_done(step)
            if step == start:
                clock.mark("first_step")  # the pipeline, a resumed checkpoint and the first step (compilation)
                if rank == 0:
                    clock.write(run_dir)
                if build_peak is not None:
                    record["build_peak_memory_gib"] = build_peak
            if step % 50 == 0:
                gc.collect(1)
            metrics.log(record)
            skipped_in_a_row = _count_nonfinite(record, step, skipped_in_a_row, recipe, run_dir)
            every = recipe.checkpoint.every
            at_end = step == last and (recipe.checkpoint.at_end or stop_after is not None)
            if at_end or (every and (step + 1) % every == 0):
                with heartbeat.paused():  # its barriers wait for the other ranks
                    saved = save_checkpoint(run_dir, trainee.model, trainee.optimizer, step,
                                            keep=recipe.checkpoint.keep)
                if at_end:
                    metrics.note(_saved_message(saved, run_dir, finished=step == recipe.steps - 1))
            if recipe.lora is not None and step == recipe.steps - 1:
                with heartbeat.paused():
                    _save_adapter(recipe, trainee.model, trainee.parallel, run_dir)
            if debug.stall_at == (rank, step):
                _stall(rank, step)
    finally:
        heartbeat.close()
        gc.enable()
        metrics.close()


def _row_loader(recipe: Recipe, config: Any, run_dir: Path, parallel: ParallelState, *, rank: int, world: int):
    """The run's rows, checked against the model (their directory, their vocabulary), as this rank's loader; rank 0
    prints the start banner and a warning when the steps leave rows unread or repeat them."""
    from openrecipes.config.layout import rows_per_microbatch
    from openrecipes.data.batching import RowLoader, load_rows

    rows = _rows_to_train_on(recipe, run_dir)
    dataset = load_rows(rows)
    check_rows_directory(recipe, config, rows)
    check_rows_vocabulary(recipe, config, rows, int(dataset.input_ids.max()))
    loader = RowLoader(dataset=dataset, global_batch=recipe.global_batch, dp_rank=parallel.dp_rank,
                       dp_size=parallel.dp_size,
                       rows_per_microbatch=rows_per_microbatch(recipe.layout, dataset.row_tokens))
    if rank == 0:
        from openrecipes.train.banner import coverage_warning, start_banner

        print(start_banner(model=recipe.model, config=config, world_size=world, layout_label=recipe.layout.label(),
                           rows=len(dataset), row_tokens=dataset.row_tokens, steps=recipe.steps,
                           global_batch=recipe.global_batch, run_dir=run_dir), file=sys.stderr, flush=True)
        warning = coverage_warning(steps=recipe.steps, global_batch=recipe.global_batch, rows=len(dataset))
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return loader


def _optimizer(recipe: Recipe, model, parallel: ParallelState) -> MixedPrecisionAdam:
    """The recipe's Adam over the trainable parameters: a frozen base (lora) has no gradients and no state."""
    opt = recipe.optimizer
    master = "param" if engine.parameter_dtype(recipe, parallel) == torch.float32 else recipe.optimizer_master()
    return MixedPrecisionAdam([p for p in model.parameters() if p.requires_grad], AdamConfig(
        lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, master=master,
        moment_dtype=opt.moment_dtype, offload_fraction=recipe.offload.fraction, overlap=recipe.offload.overlap,
        offload_update=recipe.offload.update))


def _pipeline(recipe: Recipe, config: Any, model, parallel: ParallelState, device: torch.device,
              rows_per_microbatch: int):
    """This rank's (interleaved) 1F1B schedule over its stages, or None without pipeline parallelism."""
    if parallel.pp_size == 1:
        return None
    from openrecipes.config.layout import rank_layers
    from openrecipes.parallel.pipeline import build_pipeline

    per_rank_rows = recipe.global_batch // parallel.dp_size
    chunks = rank_layers(recipe.layout, config.num_hidden_layers, parallel.pp_rank)
    stage_loss = engine.StageLoss(_sequence_slices(parallel)[1],
                                  head_computes_loss=bool(recipe.kernels.loss_chunk_tokens))
    return build_pipeline(model, chunks, num_stages=parallel.pp_size * recipe.layout.vpp, device=device,
                          group=parallel.pp_group, microbatches=-(-per_rank_rows // rows_per_microbatch),
                          loss_fn=stage_loss, loss_inputs=stage_loss.loss_inputs(model))


def _count_nonfinite(record: dict, step: int, skipped_in_a_row: int, recipe: Recipe, run_dir: Path) -> int:
    """Non-finite steps in a row after this one; raises TrainingStopped where the run must stop (always, unless
    debug.skip_nonfinite_steps, and then past debug.max_consecutive_skips in a row)."""
    if math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]):
        return 0
    skipped_in_a_row += 1
    debug = recipe.debug
    if debug.skip_nonfinite_steps and skipped_in_a_row <= debug.max_consecutive_skips:
        return skipped_in_a_row
    previous = latest_checkpoint(run_dir)
    skips = (f" after {skipped_in_a_row - 1} skipped steps in a row (debug.max_consecutive_skips)"
             if debug.skip_nonfinite_steps else "")
    raise TrainingStopped(f"step {step}: non-finite loss {record['loss']} or gradient norm {record['grad_norm']}"
                          f"{skips}; the update was not applied; last good checkpoint: {previous or 'none'}")


def _save_adapter(recipe: Recipe, model, parallel: ParallelState, run_dir: Path) -> None:
    """The trained adapters in PEFT's format (rank 0 writes; pipeline stages gather theirs)."""
    from openrecipes.checkpoint.lora import save_peft_adapter

    save_peft_adapter(model, engine.lora_spec(recipe), run_dir / ADAPTER_DIR, base_model=adapter_base(recipe, run_dir),
                      write=parallel.rank == 0, stage_group=parallel.pp_group if parallel.pp_size > 1 else None)


def _saved_message(saved: Path, run_dir: Path, *, finished: bool) -> str:
    """What the last save of this invocation is, and (steps left) how to go on from it."""
    if finished:
        return f"openrecipes train: saved {saved.name}"
    resume = f"openrecipes train --resume {shlex.quote(str(run_dir))}"
    return f"openrecipes train: saved {saved.name} (resume with: {resume})"


def _stall(rank: int, step: int) -> None:
    """debug.stall_at: hang in Python between steps, as a stuck rank would (the heartbeat ends the job)."""
    print(f"openrecipes train: rank {rank} stalls after step {step} (debug.stall_at)", file=sys.stderr, flush=True)
    while True:
        time.sleep(60)


def _sequence_slices(parallel: ParallelState) -> tuple:
    """(context slice, this rank's slice) of a (B, T, ...) tensor, each None where it is the whole: context
    parallelism cuts a row into cp contiguous chunks, tensor (sequence) parallelism each chunk into tp parts."""
    from openrecipes.parallel.tensor import local_sequence_slice

    if max(parallel.tp_size, parallel.cp_size) == 1:
        return None, None
    cp_slice = (lambda t: local_sequence_slice(t, parallel.cp_mesh)) if parallel.cp_size > 1 else None
    if parallel.tp_size == 1:
        return cp_slice, cp_slice
    tp_slice = lambda t: local_sequence_slice(t, parallel.tp_mesh)  # noqa: E731
    return cp_slice, tp_slice if cp_slice is None else (lambda t: tp_slice(cp_slice(t)))


def train_step(model, optimizer, loader, recipe: Recipe, step: int, device: torch.device, grads: GradientSync,
               parallel: ParallelState, pipeline=None, *, timed: bool = False) -> dict:
    """One optimizer step. ``timed``: the record also holds each phase's seconds (``phase_times_s``: each
    microbatch's forward and backward, or the pipeline's forward_backward, the gradient sync and norm, the optimizer),
    the device drained between phases (train/rank_measure.py)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    trace = MemoryTrace(device, recipe.debug.memory_trace, timed=timed)
    microbatches = loader.microbatches(step)
    counts = torch.tensor([sum(float(engine.loss_weights(b).sum()) for b in microbatches),
                           sum(_sum_doc_len_sq(b) for b in microbatches)], dtype=torch.float64, device=device)
    if parallel.dense_mesh is not None:  # data-parallel ranks hold different rows
        dist.all_reduce(counts, group=parallel.dense_mesh.get_group())
    supervised, sum_doc_len_sq = counts.tolist()
    if supervised == 0:
        raise ValueError(f"step {step}: the global batch has no supervised tokens")
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    aux_coef, aux_sum = recipe.moe.aux_loss_coef, torch.zeros((), dtype=torch.float64, device=device)
    grads.begin_step(len(microbatches))
    # context parallelism feeds each rank its chunk of the tokens and positions (documents stay whole); the loss
    # reads the rank's own slice of the targets
    cp_slice, target_slice = _sequence_slices(parallel)
    loss_fn = engine.loss_function(recipe.kernels.compile)
    whole_rows = loader.dataset.one_document_per_row
    mtp = engine.mtp_objective(recipe, model, microbatches, device, parallel)
    if pipeline is not None:
        loss_sum += _pipeline_step(pipeline, microbatches, supervised, device, cp_slice,
                                   pipeline_image_inputs(model, microbatches))
    for index, batch in enumerate(microbatches if pipeline is None else []):
        # max_seqlen stays on the host: reading it back from the GPU would stall the step
        batch = {k: v if k == "max_seqlen" else v.to(device, non_blocking=True) for k, v in batch.items()}
        with engine.router_statistics(model, aux_coef, batch) as routing:
            micro_loss = engine.microbatch_loss_sum(model, batch, target_slice, input_slice=cp_slice,
                                                    loss_fn=loss_fn, whole_rows=whole_rows, mtp=mtp)
        # each microbatch's forward (the loss included) and backward apart: the peak is one of those moments
        suffix = f"_{index + 1}" if len(microbatches) > 1 else ""
        trace.mark(f"forward{suffix}")
        objective = micro_loss / supervised if mtp is None else micro_loss / supervised + mtp.take()
        if routing is not None:  # the step's load-balancing loss is the mean of its rows' (RouterStatistics)
            micro_aux = routing.losses().sum() / recipe.global_batch
            objective = objective + aux_coef * micro_aux
            aux_sum += micro_aux.detach().double()
        grads.before_backward(last=index == len(microbatches) - 1)
        objective.backward()
        grads.after_backward()
        trace.mark(f"backward{suffix}")
        loss_sum += micro_loss.detach().double()
    if pipeline is not None:
        trace.mark("forward_backward")
    loss_total = _all_reduce(loss_sum)
    grads.synchronize()
    lr = lr_at(step, total_steps=recipe.steps, lr=recipe.optimizer.lr, min_lr=recipe.optimizer.min_lr,
               warmup_fraction=recipe.optimizer.warmup_fraction, decay=recipe.optimizer.decay)
    loss_total, grad_norm = _update(optimizer, grads, loss_total, lr=lr, grad_clip=recipe.optimizer.grad_clip,
                                    device=device, parallel=parallel, trace=trace)
    loss = loss_total / supervised
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
              "tokens": recipe.global_batch * loader.dataset.row_tokens, "supervised_tokens": int(supervised),
              "sum_doc_len_sq": int(sum_doc_len_sq), "step_time_s": time.perf_counter() - started,
              "peak_memory_gib": None, "peak_reserved_gib": None}
    if aux_coef > 0:
        record["aux_loss"] = float(_all_reduce(aux_sum))
    if mtp is not None:
        record["mtp_loss"] = mtp.per_token_loss()
    if device.type == "cuda":
        peaks = _all_reduce(torch.tensor([trace.peak_allocated(), torch.cuda.max_memory_reserved(device)],
                                         dtype=torch.float64, device=device), op=dist.ReduceOp.MAX if dist.is_initialized() else None)
        record["peak_memory_gib"], record["peak_reserved_gib"] = (peaks / 2**30).tolist()
    if parallel.pp_size > 1:
        record[PEAK_MEMORY_PER_STAGE] = peak_gib_per_stage(
            rank_peak_bytes(device, trace.peak_allocated() if device.type == "cuda" else None),
            parallel.pp_rank, parallel.pp_size, device)
    if trace.phases:
        record["memory_phases_gib"] = trace.phases
    if timed:
        record["phase_times_s"] = trace.times
    return record


def _update(optimizer, grads: GradientSync, loss_total: torch.Tensor, *, lr: float, grad_clip: float | None,
            device: torch.device, parallel: ParallelState, trace: MemoryTrace) -> tuple[float, float]:
    """Clip and apply the step's gradients unless the loss or the norm is not finite; (loss sum, gradient norm).

    The norm, the clip factor and the skip stay on the device, and the two figures are read back once the update is
    queued: a read before it drained the GPU while the host still had the optimizer's launches to make (a LoRA step's
    GPU waited there, BENCHMARKS.md call x)."""
    norm = grad_norm_squared(grads.gradients(), device,
                             stage_group=parallel.pp_group if parallel.pp_size > 1 else None).sqrt()
    nonfinite = ~(torch.isfinite(norm) & torch.isfinite(loss_total))
    for group in optimizer.param_groups:
        group["lr"] = lr
    trace.mark("gradient_sync_and_norm")
    optimizer.step(grad_scale=clip_scale(norm, grad_clip), skip=nonfinite)
    trace.mark("optimizer")
    grads.zero()
    # the loss sum and the norm are fp64 already
    loss_sum, grad_norm, skipped = torch.stack([loss_total, norm, nonfinite.double()]).tolist()
    if skipped:
        optimizer.forget_skipped_step()
    return loss_sum, grad_norm


def _pipeline_step(pipeline, microbatches: list[dict], supervised: float, device: torch.device,
                   cp_slice=None, images: dict | None = None) -> torch.Tensor:
    """Run the step's microbatches through the (interleaved) 1F1B schedule; returns this rank's loss sum (the last
    stage's). ``images``: the rows' image inputs and whole-row positions (``pipeline_image_inputs``)."""
    import torch.nn.functional as F

    stacked = {k: torch.cat([b[k] for b in microbatches]).to(device) for k in ("input_ids", "position_ids",
                                                                                "document_ids")}
    weights = torch.cat([F.pad(engine.loss_weights(b), (0, 1)) for b in microbatches]).to(device)
    target = torch.stack([torch.roll(stacked["input_ids"], -1, dims=1), weights], dim=-1)
    if cp_slice is not None:  # the loss slices the targets itself (StageLoss.sequence_slice)
        stacked["input_ids"], stacked["position_ids"] = cp_slice(stacked["input_ids"]), cp_slice(stacked["position_ids"])
    images = {k: v.to(device) for k, v in (images or {}).items()}
    if images:  # refused with cp (train/images.py): the positions are the whole rows'
        stacked["position_ids"] = images.pop("position_ids")
    pipeline.loss.supervised_tokens = supervised
    losses: list[torch.Tensor] = []
    args = (stacked["input_ids"],) if pipeline.is_first else ()
    # a chunked loss head reads the targets in the last stage's forward (every stage gets the same kwargs)
    head_inputs = {"loss_target": target} if pipeline.loss.head_computes_loss else {}
    pipeline.schedule.step(*args, position_ids=stacked["position_ids"], document_ids=stacked["document_ids"],
                           **head_inputs, **images, target=target if pipeline.is_last else None,
                           losses=losses if pipeline.is_last else None)
    if not pipeline.is_last:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([l.detach().double() for l in losses]).sum() * supervised


def _sum_doc_len_sq(batch: dict) -> float:
    lengths = (batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]).double()
    return float((lengths * lengths).sum())
