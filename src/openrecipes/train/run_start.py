"""Where a run starts: what a fresh run records in its directory (run.json), whether an earlier run there may be
written over or is finished, and the step a resume starts at."""

from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from openrecipes.checkpoint.training_save import latest_checkpoint, load_checkpoint
from openrecipes.config.recipe import Recipe, dump_recipe
from openrecipes.config.rundir import (RECIPE_FILE, RESUMES_FILE, RUN_FILE, RunGpuInfo, RunInfo, RunModelInfo,
                                       checkpoint_step, write_run_info)
from openrecipes.train.metrics import truncate_after
from openrecipes.train.resume import record_inputs, record_resume
from openrecipes.utils import atomic_write_text
from openrecipes.version import __version__


def gpu_type(device: torch.device) -> str:
    from openrecipes.config.hardware import CPU_TYPE, known_gpu_name

    if device.type != "cuda":
        return CPU_TYPE

    return known_gpu_name(torch.cuda.get_device_name(device))


def run_gpu_info(device: torch.device, world: int) -> RunGpuInfo:
    """run.json's gpu: the device type and count, and for a CPU run the host's memory (GB), which its card states as
    the device memory (a GPU's is the hardware table's)."""
    from openrecipes.utils import host_memory_bytes

    kind = gpu_type(device)
    if device.type == "cuda":
        return RunGpuInfo(type=kind, count=world)
    return RunGpuInfo(type=kind, count=world, memory_gb=round(host_memory_bytes() / 1e9, 1))


def run_info(recipe: Recipe, config, device: torch.device, command: str, world: int, row_tokens: int,
             rows_per_microbatch: int) -> RunInfo:
    return RunInfo(
        command=command,
        started=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        model=RunModelInfo(name=recipe.model, active_params=config.active_params(),
                           total_params=config.total_params(), num_layers=config.num_hidden_layers,
                           hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                           head_dim=config.head_dim),
        gpu=run_gpu_info(device, world),
        world_size=world, global_batch=recipe.global_batch, row_tokens=row_tokens,
        rows_per_microbatch=rows_per_microbatch, steps=recipe.steps,
        versions={"openrecipes": __version__, "torch": torch.__version__, "python": platform.python_version(),
                  "cuda": torch.version.cuda})


def never_saved(run_dir: Path) -> bool:
    """A run of this tool (its run.json and recipe.yaml) killed before its first checkpoint was complete: nothing in
    it is worth keeping, so a fresh start may write over it (its metrics lines and records, nothing else)."""
    return ((run_dir / RUN_FILE).is_file() and (run_dir / RECIPE_FILE).is_file()
            and latest_checkpoint(run_dir) is None)


def finished(run_dir: Path, steps: int) -> bool:
    """Whether the newest save of ``run_dir`` is of its last step (a resume would train nothing)."""
    saved = latest_checkpoint(run_dir)
    return saved is not None and checkpoint_step(saved) >= steps - 1


def resumed_step(run_dir: Path, recipe: Recipe, model, optimizer, changes: dict, rank: int) -> int:
    """The step a resume starts at, after loading the newest complete save (0 without one); rank 0 drops the
    metrics past it and records the resume."""
    start = 0
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        start = load_checkpoint(checkpoint, model, optimizer) + 1
        if rank == 0:
            print(f"openrecipes train: resuming from {checkpoint.name}", file=sys.stderr, flush=True)
    elif rank == 0:  # killed before (or during) its first save: the run starts again from the seed
        print(f"openrecipes train: {run_dir} has no complete checkpoint; resuming from step 0",
              file=sys.stderr, flush=True)
    if rank == 0:
        truncate_after(run_dir, start - 1)
        record_resume(run_dir, recipe, changes, start)
    return start


def record_fresh_start(run_dir: Path, recipe: Recipe, info: RunInfo) -> None:
    """What a run from step 0 writes before its first step: its recipe, its inputs (what a resume is compared
    against, train/resume.py) and run.json. Over a run that never saved (``never_saved``), its metrics lines and
    resume records go first."""
    truncate_after(run_dir, -1)
    (run_dir / RESUMES_FILE).unlink(missing_ok=True)
    atomic_write_text(run_dir / RECIPE_FILE, dump_recipe(recipe))
    record_inputs(run_dir, recipe)
    write_run_info(run_dir, info)
