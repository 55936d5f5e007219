"""What `openrecipes train` says when it starts: the model, the job, the data and where the files go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openrecipes.config.recipe import Recipe


def epochs(steps: int, global_batch: int, rows: int) -> float:
    """How many times ``steps`` optimizer steps of ``global_batch`` rows go over ``rows`` rows."""
    return steps * global_batch / rows


def start_banner(*, model: str, config: Any, world_size: int, layout_label: str, rows: int, row_tokens: int,
                 steps: int, global_batch: int, run_dir: Path) -> str:
    """Lines printed once (rank 0) before the first step."""
    return "\n".join([
        f"openrecipes train: model {model}: {config.total_params():,} parameters, N = {config.active_params():,} "
        "active per token (MFU uses 6·N)",
        f"  {world_size} process(es), layout {layout_label}",
        f"  {rows:,} rows of {row_tokens:,} tokens; {steps} steps x {global_batch} rows cover "
        f"{epochs(steps, global_batch, rows):.2f} epoch(s)",
        f"  run directory {Path(run_dir).resolve()}",
    ])


def coverage_warning(*, steps: int, global_batch: int, rows: int) -> str | None:
    """A warning when the steps train on the same rows more than once (each row is seen again in a later epoch)."""
    covered = epochs(steps, global_batch, rows)
    if covered <= 1:
        return None
    return (f"openrecipes train: warning: {steps} steps x global_batch {global_batch} = {steps * global_batch:,} "
            f"rows, but the data has {rows:,}: every row is trained on {covered:.2f} times (build more rows, "
            "or lower steps or global_batch, to see each once)")


def cpu_precision_note(recipe: Recipe, device_type: str) -> str | None:
    """A note when bf16 training runs on a CPU: most CPUs have no bf16 arithmetic, so torch converts every operand
    and a tiny model's step takes 2 to 3 times as long as in fp32. None on a GPU, in fp32, or with fp8 (which needs
    bf16)."""
    if device_type != "cpu" or recipe.precision != "bf16" or recipe.fp8 is not None:
        return None
    sets = ["precision=fp32"]
    if recipe.optimizer.precision_aware:
        sets.append("optimizer.precision_aware=false")
    if recipe.offload.fraction:
        sets.append("offload.fraction=0")
    return ("openrecipes train: note: bf16 training on a CPU, where fp32 is usually 2-3x faster (`"
            + " ".join(f"--set {item}" for item in sets) + "` trains in fp32)")
