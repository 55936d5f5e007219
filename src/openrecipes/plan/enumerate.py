"""Evaluate one layout, or enumerate the valid ones and rank those that fit by predicted tokens/s/GPU."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable

from openrecipes.config.layout import LayoutConfig, LayoutModel, LayoutWorkload, unsupported_reason, validate_layout
from openrecipes.config.layout_space import enumerate_layouts
from openrecipes.plan.hardware import Hardware
from openrecipes.plan.lora import LoraSetup
from openrecipes.plan.memory import StageMemory, TrainingSetup, stage_memory
from openrecipes.plan.shape import ModelShape
from openrecipes.plan.throughput import Throughput, estimate_throughput


@dataclass(kw_only=True)
class Plan:
    layout: LayoutConfig
    setup: TrainingSetup
    stage_layers: list[int]
    stages: list[StageMemory]
    throughput: Throughput
    capacity_gib: float
    engine_refusal: str | None = None  # why openrecipes train cannot run this layout for this model (None: it can)

    @property
    def peak_memory_gib(self) -> float:
        return max(s.reserved_gib for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.peak_memory_gib <= self.capacity_gib

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "peak_memory_gib": round(self.peak_memory_gib, 2),
            "per_stage_memory_gib": [round(s.reserved_gib, 2) for s in self.stages],
            "per_stage_allocated_gib": [round(s.allocated_gib, 2) for s in self.stages],
            "predicted_tokens_per_s_per_gpu": round(self.throughput.tokens_per_s_per_gpu, 2),
            "predicted_mfu": round(self.throughput.mfu, 4),
            "gpu_memory_gib": self.capacity_gib,
            "layout": self.layout.model_dump(),
            "stage_layers": self.stage_layers,
            "recompute": self.setup.recompute,
            "optimizer": self.setup.optimizer,
            "offload_fraction": self.setup.offload_fraction,
            "offload_update": self.setup.offload_update,
            "microbatches": self.throughput.microbatches,
            "bubble_fraction": round(self.throughput.bubble_fraction, 4),
            "step_time_s": round(self.throughput.step_time_s, 3),
            "cpu_optimizer_gib_per_rank": round(max(s.cpu_optimizer_gib for s in self.stages), 2),
            "host_gib_per_rank": round(max(s.host_gib for s in self.stages), 2),
            "host_parts_gib": [{k: round(v, 3) for k, v in s.host_parts_gib.items()} for s in self.stages],
            "engine": self.setup.engine,
            "openrecipes_runs_it": self.engine_refusal is None,
            "memory_parts_gib": [s.parts_gib for s in self.stages],
            "time_parts_s": self.throughput.parts_s,
        }


AUTO_ENGINE = "auto"


def engine_for(layout: LayoutConfig, engine: str, model: LayoutModel | None = None) -> str:
    """The engine whose memory and speed are predicted: ``auto`` is this engine when it runs ``layout`` (for
    ``model``'s family), else the generic (Megatron-LM) model; an engine named explicitly is kept."""
    if engine != AUTO_ENGINE:
        return engine
    return "openrecipes" if unsupported_reason(layout, model) is None else "megatron"


def offload_update_for(engine: str) -> str:
    """Where a plan updates offloaded optimizer state: this engine as a recipe does unless it says otherwise (the
    recipe's default, ``config/recipe.py`` ``Offload.update``); Megatron-LM on the CPU (its CPU optimizer)."""
    from openrecipes.config.recipe import Offload

    return Offload.model_fields["update"].default if engine == "openrecipes" else "host"


def evaluate(shape: ModelShape, layout: LayoutConfig, setup: TrainingSetup, hw: Hardware, *,
             workload: LayoutWorkload | None = None) -> Plan:
    """Memory and throughput of one layout; raises ValueError naming the recipe key when the layout rules
    (``layout_problems``, with what ``workload`` says of the run) refuse it."""
    model = shape.layout_model()
    counts = validate_layout(layout, world_size=layout.world_size, model=model, workload=workload)
    return Plan(layout=layout, setup=setup, stage_layers=counts,
                stages=stage_memory(shape, layout, counts, setup, hw),
                throughput=estimate_throughput(shape, layout, counts, setup, hw),
                capacity_gib=hw.gpu.memory_gib, engine_refusal=unsupported_reason(layout, model))


# The most layout settings one ranking evaluates. Each costs a memory model per pipeline stage (about a millisecond
# on one core), and a large model on a large fleet has hundreds of thousands (Muse Spark on 1,024 GPUs: 350,000, some
# minutes), more with more layers to split into stages. Past it, every setting of an evenly spaced sample of the
# layouts is evaluated (each parallelism family keeps its share), and the plan says how many were left out.
MAX_PLAN_EVALUATIONS = 50_000


def _sampled(layouts: list[LayoutConfig], settings: int) -> list[LayoutConfig]:
    """The layouts whose settings are evaluated: all, or an evenly spaced sample within MAX_PLAN_EVALUATIONS."""
    keep = max(1, MAX_PLAN_EVALUATIONS // max(1, settings))
    if len(layouts) <= keep:
        return layouts
    return [layouts[i * len(layouts) // keep] for i in range(keep)]


def capped_note(evaluated: int, valid: int) -> str | None:
    """What a plan says when MAX_PLAN_EVALUATIONS cut its enumeration (None when every valid setting was
    evaluated)."""
    if evaluated >= valid:
        return None
    return (f"evaluated {evaluated:,} of {valid:,} valid layout settings (MAX_PLAN_EVALUATIONS = "
            f"{MAX_PLAN_EVALUATIONS:,}: every setting of an evenly spaced sample of the layouts); the best layout may "
            "be among those left out: fix a setting (--max-tokens-per-gpu, --recompute, --optimizer, "
            "--offload-fraction) to rank fewer in full")


def search(shape: ModelShape, world_size: int, hw: Hardware, *, max_tokens: Iterable[int],
           recompute: Iterable[str], optimizers: Iterable[str], offloads: Iterable[float],
           global_batch_tokens: int, max_tp: int = 8, engine: str = "megatron",
           lora: LoraSetup | None = None) -> tuple[list[Plan], int, int]:
    """All valid layouts x training settings, at most MAX_PLAN_EVALUATIONS of them (``capped_note``); returns (plans
    that fit, best first; number evaluated; number valid). ``engine`` ``auto`` predicts each layout with the engine
    ``engine_for`` picks for it."""
    layouts: list[LayoutConfig] = []  # each with its max_tokens_per_gpu
    model = shape.layout_model()
    for tokens in max_tokens:
        found = enumerate_layouts(world_size, model=model, max_tokens_per_gpu=tokens,
                                  max_tp=min(max_tp, hw.gpu.nvlink_domain))
        if engine == "openrecipes":  # rank only what this engine can run
            found = [layout for layout in found if unsupported_reason(layout, model) is None]
        layouts += found
    settings = list(itertools.product(recompute, optimizers, offloads))
    fitting: list[Plan] = []
    evaluated = 0
    for layout, (mode, opt, off) in itertools.product(_sampled(layouts, len(settings)), settings):
        chosen = engine_for(layout, engine, model)
        setup = TrainingSetup(recompute=mode, optimizer=opt, offload_fraction=off,
                              offload_update=offload_update_for(chosen), global_batch_tokens=global_batch_tokens,
                              engine=chosen, lora=lora)
        counts = validate_layout(layout, world_size=world_size, model=model)
        evaluated += 1
        stages = stage_memory(shape, layout, counts, setup, hw)
        if max(s.reserved_gib for s in stages) > hw.gpu.memory_gib:
            continue  # throughput only for layouts that fit
        fitting.append(Plan(layout=layout, setup=setup, stage_layers=counts, stages=stages,
                            throughput=estimate_throughput(shape, layout, counts, setup, hw),
                            capacity_gib=hw.gpu.memory_gib, engine_refusal=unsupported_reason(layout, model)))
    fitting.sort(key=lambda p: -p.throughput.tokens_per_s_per_gpu)
    return fitting, evaluated, len(layouts) * len(settings)
