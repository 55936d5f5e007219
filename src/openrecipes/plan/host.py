"""Host memory of a run, planned before it starts: what the planner predicts each node's processes keep in host
memory (``plan/memory.py``: offloaded optimizer state, the gradient copies its CPU update reads, offloaded
activations, each process's own allowance), against what the host has available. ``openrecipes train`` refuses a
run that would not fit, before any process starts (a host out of memory kills the job without a message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openrecipes.config.layout import LayoutWorkload, stage_layer_counts
from openrecipes.config.recipe import Recipe
from openrecipes.plan.hardware import GIB, Hardware, load_hardware
from openrecipes.plan.lora import LoraSetup
from openrecipes.plan.memory import TrainingSetup, stage_memory
from openrecipes.plan.shape import model_shape


def recipe_setup(recipe: Recipe, row_tokens: int) -> TrainingSetup:
    """The planner's training settings of a recipe run by this engine."""
    return TrainingSetup(recompute=recipe.recompute.granularity,
                         optimizer="precision-aware" if recipe.optimizer.precision_aware else "adam",
                         offload_fraction=recipe.offload.fraction, offload_update=recipe.offload.update,
                         engine="openrecipes",
                         global_batch_tokens=recipe.global_batch * row_tokens,
                         loss_chunk_tokens=recipe.kernels.loss_chunk_tokens,
                         offload_activations=recipe.offload.activations, compiled=recipe.kernels.compile,
                         allocator=recipe.kernels.allocator, attention_kernel=recipe.kernels.attention,
                         recompute_layers=recipe.recompute.num_layers if recipe.recompute.method == "block" else None,
                         optimizer_state_bytes=optimizer_state_bytes(recipe),
                         train_projection=recipe.vision.train_projection,
                         lora=None if recipe.lora is None else LoraSetup(rank=recipe.lora.rank,
                                                                         targets=tuple(recipe.lora.targets)))


def plan_recipe(recipe: Recipe, shape: Any, hardware: Hardware, row_tokens: int) -> Any:
    """The planner's ``Plan`` of a recipe's run as `openrecipes train` runs it (``recipe_setup``), on rows of
    ``row_tokens``: the rows per microbatch the recipe's, or what its token budget holds."""
    from openrecipes.config.layout import rows_per_microbatch
    from openrecipes.plan.enumerate import evaluate

    layout = recipe.layout
    if layout.rows_per_microbatch is None:  # the planner reads the rows from the layout
        layout = layout.model_copy(update={"rows_per_microbatch": rows_per_microbatch(layout, row_tokens)})
    return evaluate(shape, layout, recipe_setup(recipe, row_tokens), hardware)


def recipe_workload(recipe: Recipe, config: Any, *, row_tokens: int | None, image_rows: bool) -> LayoutWorkload:
    """What the layout rules (config/layout.py ``layout_problems``) check of a recipe's run on rows of
    ``row_tokens`` tokens (``image_rows``: they hold images, whose towers run on the first pipeline stage)."""
    from openrecipes.models.families import family_for_config

    images = family_for_config(config).images if image_rows else None
    return LayoutWorkload(global_batch=recipe.global_batch, row_tokens=row_tokens, compile=recipe.kernels.compile,
                          image_rows=image_rows, aux_loss_coef=recipe.moe.aux_loss_coef, mtp=recipe.mtp is not None,
                          image_first_stage_layers=images.first_stage_layers(config) if images else 0,
                          recompute_block_layers=recipe.recompute.num_layers if recipe.recompute.method == "block"
                          and recipe.recompute.granularity != "none" else None)


def optimizer_state_bytes(recipe: Recipe) -> float:
    """Optimizer state per parameter the engine keeps (docs/train.md's table): an int16 remainder (2 B) or an fp32
    master (4 B; none for fp32 training, where the parameter is its own master) and two moments."""
    master = {"remainder": 2, "fp32": 4, "param": 0}[recipe.optimizer_master()]
    moment = 2 if recipe.optimizer.moment_dtype == "bf16" else 4
    return master + 2 * moment


@dataclass(frozen=True, kw_only=True)
class HostPrediction:
    processes: int                  # training processes on one node
    per_process_gib: list[float]    # each stage's rank
    parts_gib: dict[str, float]     # summed over the node's processes
    total_gib: float


def predict_host_memory(recipe: Recipe, config, *, row_tokens: int, processes_per_node: int,
                        hardware: Hardware | None = None) -> HostPrediction:
    """Host memory of one node: its processes spread evenly over the pipeline stages (a node holding whole stages
    or a share of each gets the same sum)."""
    layout = recipe.layout
    shape = model_shape(config, name=recipe.model)
    counts = stage_layer_counts(layout, shape.num_layers)
    stages = stage_memory(shape, layout, counts, recipe_setup(recipe, row_tokens), hardware or load_hardware("H200"))
    per_stage = processes_per_node / len(stages)
    parts: dict[str, float] = {}
    for stage in stages:
        for name, gib in stage.host_parts_gib.items():
            parts[name] = parts.get(name, 0.0) + gib * per_stage
    return HostPrediction(processes=processes_per_node, per_process_gib=[s.host_gib for s in stages],
                          parts_gib=parts, total_gib=sum(parts.values()))


def available_host_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of this host (bytes), or None where the kernel does not report it."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def check_host_memory(prediction: HostPrediction, available_bytes: int | None) -> None:
    """Refuse (ValueError, one line) a run whose predicted host memory exceeds what the host has available."""
    if available_bytes is None or prediction.total_gib * GIB <= available_bytes:
        return
    parts = ", ".join(f"{name} {gib:,.1f}" for name, gib in prediction.parts_gib.items() if gib)
    raise ValueError(f"host memory: this run needs about {prediction.total_gib:,.1f} GiB on this host "
                     f"({prediction.processes} process(es): {parts} GiB), but only "
                     f"{available_bytes / GIB:,.1f} GiB is available (MemAvailable); lower offload.fraction, turn "
                     "off offload.activations, or use more hosts")
