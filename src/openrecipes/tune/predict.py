"""The planner as the tuner uses it: which candidates the engine can run, what they should reach, and a refit of
the prediction from the trials measured so far.

Predictions are ``openrecipes plan --engine openrecipes``'s (``plan.enumerate.evaluate``). A candidate is refused
by the one layout rule train applies (``config.layout.layout_problems``, ``unsupported_reason``) and pruned when its
predicted peak memory, after the memory refit, does not fit the device.

The refit (``Calibration``): the measured step time of every finished trial against two features of its plan,
the planner's step time and the count of layer-microbatches on the busiest stage (a fixed cost per layer and
microbatch, which the FLOP model does not have and which dominates small models and host-bound runs), fitted by
least squares on relative errors. With one trial, or when the two-term fit is not positive, it falls back to one
ratio (the geometric mean of measured over predicted). The planner has no model of compiled blocks: a compiled
candidate's step time is the eager one divided by ``compile_speedup``, a prior from BENCHMARKS.md (the target's
measured effect) that the refit replaces once eager and compiled trials were both measured. A run may start from
an earlier run's refit of the same model family and GPU type (``tune/family_calibration.py``, ``--calibration``).

Memory is corrected by an offset: the mean of measured peak minus predicted allocated memory of the trials that
measured one (GPUs), the planner's error being mostly a fixed amount (the measured table in BENCHMARKS.md). The
planner models compiled blocks' fused loss and their fewer saved tensors (plan/memory.py), so no prior is kept; what
compiled candidates still differ by is a residual of ``compiled_saving_bytes`` per logits element, fitted once both
kinds were measured. An out-of-memory trial is a measurement too: it bounds its region, every candidate predicted to
need as much memory or more is refused ("above a measured out-of-memory").
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from openrecipes.config.hardware import GpuSpec, known_gpu_name, parse_gpus
from openrecipes.config.layout import (LayoutConfig, LayoutWorkload, layout_problems, unsupported_reason,
                                      with_world_size)
from openrecipes.config.recipe import Recipe
from openrecipes.plan.enumerate import Plan
from openrecipes.plan.hardware import Hardware, load_hardware
from openrecipes.plan.host import plan_recipe, recipe_workload
from openrecipes.plan.shape import ModelShape, model_shape

CPU = "cpu"
# measured step-time ratio eager / compiled blocks (BENCHMARKS.md, one H200, 8 layers at Qwen3-30B-A3B widths, full
# recompute: 0.202 s eager, 0.170 s compiled); targets without a measurement get no prior and rank compile later
COMPILE_SPEEDUP_PRIOR = {"H200": 0.202 / 0.170}
# the share of a device's memory a ranked candidate (and a solved knob: offload fraction, recomputed layers) leaves
# free until measured peaks say how far off the refitted model is (``refined_margin``)
MEMORY_MARGIN = 0.05
# measured, the margin is the worst under-prediction seen plus MARGIN_ALLOWANCE, never below MIN_MEMORY_MARGIN (a few
# trials predicted well are not evidence that a candidate may fill the device) nor above MEMORY_MARGIN (a larger
# error is bounded by the out-of-memory it causes and the refit after it, not by a margin)
MIN_MEMORY_MARGIN = 0.02
MARGIN_ALLOWANCE = 0.01
# a candidate predicted within this share below a measured out-of-memory needs "as much": the planner's peaks of two
# settings that close (an offload fraction of a small model, say) differ by less than its error
OUT_OF_MEMORY_TOLERANCE = 0.002
# a device reporting this share less memory than the hardware table's card of its name is another size of it (an
# H100 reports 79.2 GiB against the table's 79.6: the same card)
DEVICE_MEMORY_SLACK = 0.05


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where the trials run: ``count`` devices of ``gpu_type`` ("cpu": gloo processes)."""

    count: int
    gpu_type: str
    # what this machine's devices report (the smallest), for ``--gpus auto``: a 40 GB card or a MIG slice shares its
    # type's name with the hardware table's full-size card
    device_memory_gib: float | None = None

    @property
    def is_cpu(self) -> bool:
        return self.gpu_type.lower() == CPU

    def label(self) -> str:
        return f"{self.count}x{self.gpu_type}"


def resolve_target(text: str, layout: LayoutConfig, nproc: int | None = None) -> Target:
    """``auto`` (the GPUs of this machine, else CPU processes), ``cpu``, or COUNTxTYPE (``2xH200``, ``2xcpu``).
    CPU processes number ``nproc`` where it is given, else the start's world size. The count must be the start's
    world size, the tuner keeps it: a start that leaves dp out gets it from the count, as train does
    (``with_world_size``)."""
    text = text.strip()
    if text == "auto":
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(count)) / 1024 ** 3
            target = Target(count=count, gpu_type=known_gpu_name(torch.cuda.get_device_name(0)),
                            device_memory_gib=memory)
        else:
            target = Target(count=nproc or layout.world_size, gpu_type=CPU)
    elif text.lower() == CPU:
        target = Target(count=nproc or layout.world_size, gpu_type=CPU)
    else:
        count, gpu_type = parse_gpus(text)
        target = Target(count=count, gpu_type=CPU if gpu_type.lower() == CPU else gpu_type)
    world_size = with_world_size(layout, target.count).world_size
    if target.count != world_size:
        given = f"--nproc {nproc} with --gpus {text}" if nproc and target.is_cpu and text in ("auto", CPU) \
            else f"--gpus {text}"
        raise ValueError(f"{given}: {target.count} devices, but the start's layout (tp·pp·cp·dp) uses "
                         f"{world_size}; the tuner keeps the world size (give --gpus {world_size}x{target.gpu_type}, "
                         "or leave the start's dp out to take it from the count)")
    return target


def _host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024 ** 3


def planner_hardware(target: Target, memory_gib: float | None = None) -> Hardware:
    """The planner's hardware record. A CPU has none: its numbers here are placeholders (an H200's efficiencies,
    a slow device, host memory shared by the processes); the refit from the measured start rescales them.
    ``memory_gib`` (``--gpu-memory-gib``) replaces one device's memory, what every candidate must fit."""
    if memory_gib is not None and not (math.isfinite(memory_gib) and memory_gib > 0):
        raise ValueError(f"--gpu-memory-gib: a finite number of GiB above 0, got {memory_gib}")
    if not target.is_cpu:
        hardware = load_hardware(target.gpu_type, memory_gib=memory_gib)
        return hardware if memory_gib is not None else _within_the_device(hardware, target.device_memory_gib)
    base = load_hardware("H200")
    spec = GpuSpec(name=CPU, peak_bf16_dense_flops=1e10, memory_gib=memory_gib or _host_memory_gib() / target.count,
                   hbm_tb_s=0.02, nvlink_gb_s=2.0, nvlink_domain=max(8, target.count), network_gb_s=1.0,
                   pcie_gb_s=10.0, source="placeholder for CPU trials (openrecipes tune)")
    return dataclasses.replace(base, gpu=spec)


def _within_the_device(hardware: Hardware, device_gib: float | None) -> Hardware:
    """The table's card, with the memory of the device the trials run on where that is clearly less (a 40 GB A100,
    a MIG slice): the table's figure stays otherwise, since it is what the planner's reserve model was fitted to."""
    if device_gib is None or device_gib >= hardware.gpu.memory_gib * (1 - DEVICE_MEMORY_SLACK):
        return hardware
    return dataclasses.replace(hardware, gpu=dataclasses.replace(hardware.gpu, memory_gib=round(device_gib, 1)))


@dataclass(frozen=True, kw_only=True)
class Prediction:
    tokens_per_s_per_gpu: float  # the planner's, before the refit
    step_time_s: float
    layer_microbatches: int  # microbatches x layers of the busiest stage
    allocated_gib: float  # busiest stage, comparable with a measured peak
    peak_reserved_gib: float
    capacity_gib: float
    compiled: bool = False  # kernels.compile: the planner's step time is eager; the calibration scales it
    logits_gib_per_byte: float = 0.0  # logits elements of the busiest stage's loss, in GiB per byte each
    context_gib: float = 0.0  # the part of ``peak_reserved_gib`` outside the caching allocator (CUDA context)
    # kernels.allocator "expandable": what must fit is the planner's reserve over the allocated peak; a measured
    # reserve is what the allocator kept because it could (it gives it back under pressure), not what it needed
    expandable: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    step_scale: float = 1.0
    per_layer_microbatch_s: float = 0.0
    memory_offset_gib: float = 0.0  # measured peak - predicted allocated, for eager blocks
    compiled_saving_bytes: float = 0.0  # per logits element, what compiled blocks hold less than eager ones
    fitted_on: int = 0
    compile_speedup: float = 1.0  # eager step time / compiled step time
    out_of_memory_gib: float | None = None  # the smallest planner peak (uncorrected) of a trial that ran out
    # measured peak reserved / peak allocated of the trials, (eager, compiled); None: not measured, the planner's prior
    reserve_ratio: tuple[float | None, float | None] = (None, None)
    memory_margin: float = MEMORY_MARGIN  # the share of the device a candidate must leave free (refined_margin)
    # the earlier tuner's calibration file (tune/family_calibration.py) this refit starts from; None: this run's own
    source: str | None = None

    def eager_step_time_s(self, p: Prediction) -> float:
        return self.step_scale * p.step_time_s + self.per_layer_microbatch_s * p.layer_microbatches

    def step_time_s(self, p: Prediction) -> float:
        return self.eager_step_time_s(p) / (self.compile_speedup if p.compiled else 1.0)

    def tokens_per_s_per_gpu(self, p: Prediction) -> float:
        return p.tokens_per_s_per_gpu * p.step_time_s / self.step_time_s(p)

    def offset_gib(self, p: Prediction) -> float:
        return self.memory_offset_gib - (self.compiled_saving_bytes * p.logits_gib_per_byte if p.compiled else 0.0)

    def peak_gib(self, p: Prediction) -> float:
        """The peak reserved memory expected, what must fit the device: the allocated peak times the allocator's
        reserve as measured on trials of the same compile mode (else of the other; else, and under expandable
        segments, the planner's)."""
        eager, compiled = self.reserve_ratio
        ratio = (compiled or eager) if p.compiled else (eager or compiled)
        if ratio is None or p.expandable:
            return p.peak_reserved_gib + self.offset_gib(p)
        return self.allocated_gib(p) * ratio + p.context_gib

    def allocated_gib(self, p: Prediction) -> float:
        """The peak allocated memory expected (what a trial measures), where ``peak_gib`` adds the allocator's
        reserve that must fit the device."""
        return p.allocated_gib + self.offset_gib(p)

    def above_out_of_memory(self, p: Prediction) -> bool:
        return (self.out_of_memory_gib is not None
                and p.peak_reserved_gib >= self.out_of_memory_gib * (1.0 - OUT_OF_MEMORY_TOLERANCE))

    def fits(self, p: Prediction, margin: float = 0.0) -> bool:
        return self.peak_gib(p) <= p.capacity_gib * (1.0 - margin) and not self.above_out_of_memory(p)

    def leaves_margin(self, p: Prediction) -> bool:
        """Whether ``p`` fits with ``memory_margin`` of the device left free: what a ranked candidate must."""
        return self.fits(p, margin=self.memory_margin)

    def misfit_reason(self, p: Prediction) -> str:
        # four significant digits: a small device's figures rounded to one decimal could read as fitting
        if self.above_out_of_memory(p):
            return (f"above a measured out-of-memory: predicted {p.peak_reserved_gib:.4g} GiB uncorrected, a trial "
                    f"predicted {self.out_of_memory_gib:.4g} GiB ran out")
        limit = p.capacity_gib * (1 - self.memory_margin)
        return (f"predicted not to fit: {self.peak_gib(p):.4g} GiB of {p.capacity_gib:.4g} GiB with "
                f"{100 * self.memory_margin:.3g} % left free (at most {limit:.4g} GiB)")

    def memory_model(self) -> tuple[Any, ...]:
        """What of the refit decides which candidates fit: when it changes, the solved knobs are solved again."""
        return (self.memory_offset_gib, self.compiled_saving_bytes, self.out_of_memory_gib, self.reserve_ratio,
                self.memory_margin)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def refined_margin(under_predicted: list[float]) -> float:
    """The memory margin once trials measured how far off the refitted model's peaks were: ``under_predicted`` holds,
    per trial predicted under a refit, (measured peak - expected peak) / device memory (an out-of-memory: what its
    expected peak left free). None measured: MEMORY_MARGIN."""
    if not under_predicted:
        return MEMORY_MARGIN
    return min(MEMORY_MARGIN, max(MIN_MEMORY_MARGIN, max(under_predicted) + MARGIN_ALLOWANCE))


def fit_calibration(pairs: list[tuple[Prediction, float, float | None]], *,
                    out_of_memory: list[Prediction] = (), compile_prior: float = 1.0,
                    saving_prior: float = 0.0, reserved: list[tuple[bool, float, float]] = (),
                    under_predicted: list[float] = ()) -> Calibration:
    """Refit from (prediction, measured tokens/s/GPU, measured peak GiB or None) of the finished trials, the
    predictions of the trials that ran out of memory, (compiled, peak allocated, peak reserved) measured and the
    peaks' under-predictions (``refined_margin``)."""
    offset, saving = _fit_memory(pairs, saving_prior)
    ratios = _reserve_ratios(reserved)
    # an out-of-memory bounds its region, not the whole space: the planner's error differs between regions (rows
    # per microbatch, offload), so it prunes what is predicted to need as much and leaves the offset as measured
    bound = min((p.peak_reserved_gib for p in out_of_memory), default=None)
    memory = dict(memory_offset_gib=offset, compiled_saving_bytes=saving, out_of_memory_gib=bound,
                  reserve_ratio=ratios, memory_margin=refined_margin(list(under_predicted)))
    if not pairs:
        return Calibration(compile_speedup=compile_prior, **memory)
    scale, per_unit = _fit_step(pairs, compile_prior)
    speedup = compile_prior
    compiled = [(p, m) for p, m, _ in pairs if p.compiled]
    if compiled and len(compiled) < len(pairs):  # both measured: the ratio replaces the prior
        eager = Calibration(step_scale=scale, per_layer_microbatch_s=per_unit)
        ratios = [eager.eager_step_time_s(p) / (p.step_time_s * p.tokens_per_s_per_gpu / m) for p, m in compiled]
        speedup = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return Calibration(step_scale=scale, per_layer_microbatch_s=per_unit, fitted_on=len(pairs),
                       compile_speedup=speedup, **memory)


def _reserve_ratios(reserved: list[tuple[bool, float, float]]) -> tuple[float | None, float | None]:
    """The largest measured reserved / allocated peak ratio per compile mode (eager, compiled), at least 1: the
    allocator's reserve differs between eager and compiled blocks' allocation patterns, less between trials."""
    def largest(compiled: bool) -> float | None:
        found = [max(1.0, r / a) for c, a, r in reserved if c == compiled and a > 0 and r > 0]
        return max(found, default=None)

    return largest(False), largest(True)


def _fit_memory(pairs: list[tuple[Prediction, float, float | None]], saving_prior: float) -> tuple[float, float]:
    """(eager offset GiB, compiled saving in bytes per logits element) from the measured peaks."""
    eager = [peak - p.allocated_gib for p, _, peak in pairs if peak and not p.compiled]
    compiled = [(peak - p.allocated_gib, p.logits_gib_per_byte) for p, _, peak in pairs if peak and p.compiled]
    saving = saving_prior
    if eager and compiled and all(size > 0 for _, size in compiled):
        offset = sum(eager) / len(eager)
        saving = sum((offset - error) / size for error, size in compiled) / len(compiled)
    elif eager:
        offset = sum(eager) / len(eager)
    elif compiled:
        offset = sum(error + saving * size for error, size in compiled) / len(compiled)
    else:
        offset = 0.0
    return offset, saving


def _fit_step(pairs: list[tuple[Prediction, float, float | None]], compile_prior: float) -> tuple[float, float]:
    """(scale, cost per layer-microbatch) of the eager step time; compiled trials enter at their measured step time
    times the prior, their eager equivalent."""
    rows = [(p.step_time_s, float(p.layer_microbatches),
             p.step_time_s * p.tokens_per_s_per_gpu / measured * (compile_prior if p.compiled else 1.0))
            for p, measured, _ in pairs]  # (x1, x2, measured step time in the planner's step units)
    ratio = math.exp(sum(math.log(y / x1) for x1, _, y in rows) / len(rows))
    scale, per_unit = ratio, 0.0
    if len({x2 for _, x2, _ in rows}) > 1:
        # minimise sum((a*x1 + b*x2 - y) / y)^2: the normal equations of a 2x2 system
        w = [(x1 / y, x2 / y) for x1, x2, y in rows]
        s11 = sum(a * a for a, _ in w)
        s12 = sum(a * b for a, b in w)
        s22 = sum(b * b for _, b in w)
        t1, t2 = sum(a for a, _ in w), sum(b for _, b in w)
        det = s11 * s22 - s12 * s12
        if det > 1e-12 * s11 * s22:
            a, b = (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
            if a > 0 and b >= 0:
                scale, per_unit = a, b
    return scale, per_unit


class Planner:
    """Refusals and predictions for recipes of one model on one target."""

    def __init__(self, start: Recipe, target: Target, row_tokens: int, *, image_rows: bool = False,
                 memory_gib: float | None = None) -> None:
        from openrecipes.models.resolve import resolve_model_config

        # the config train resolves for this recipe: image rows read a checkpoint directory with its towers
        self.config = resolve_model_config(start.model, overrides=start.model_overrides, full=image_rows,
                                           from_checkpoint=start.init == "checkpoint")
        self.shape: ModelShape = model_shape(self.config, name=start.model)
        self.image_rows = image_rows  # the rows hold images
        self.hardware = planner_hardware(target, memory_gib)
        self.memory_gib = memory_gib  # --gpu-memory-gib, which takes precedence over the device's and the table's
        self.target = target
        self.row_tokens = row_tokens
        # None: no measured effect of compiled blocks on this target; compile is then explored around the best
        self.compile_prior: float | None = None if target.is_cpu else COMPILE_SPEEDUP_PRIOR.get(target.gpu_type)

    def refusal(self, recipe: Recipe) -> str | None:
        """Why train would refuse the recipe's layout (the rules train applies), or None."""
        problems = layout_problems(recipe.layout, world_size=self.target.count, model=self.shape.layout_model(),
                                   workload=self.workload(recipe))
        if problems:
            return "; ".join(f"{p.path}: {p.message}" for p in problems)
        return unsupported_reason(recipe.layout, self.shape.layout_model())

    def device_memory_note(self) -> str | None:
        """What the tuner says when the devices it runs on hold less than the table's card of their name."""
        gpu = self.hardware.gpu
        if self.target.is_cpu or self.memory_gib is not None or self.target.device_memory_gib is None:
            return None
        if gpu.memory_gib >= load_hardware(self.target.gpu_type).gpu.memory_gib:
            return None
        return (f"this machine's devices hold {gpu.memory_gib:g} GiB, less than the hardware table's "
                f"{self.target.gpu_type}: every candidate is fitted into {gpu.memory_gib:g} GiB")

    def workload(self, recipe: Recipe) -> LayoutWorkload:
        """What the layout rules check of the recipe's run on the tuner's rows."""
        return recipe_workload(recipe, self.config, row_tokens=self.row_tokens, image_rows=self.image_rows)

    def plan(self, recipe: Recipe) -> Plan:
        """The planner's whole plan of the recipe (per stage), of which ``predict`` keeps the busiest stage."""
        return plan_recipe(recipe, self.shape, self.hardware, self.row_tokens)

    def predict(self, recipe: Recipe) -> Prediction:
        plan = self.plan(recipe)
        layout, t = plan.layout, plan.throughput
        return Prediction(tokens_per_s_per_gpu=t.tokens_per_s_per_gpu, step_time_s=t.step_time_s,
                          layer_microbatches=(t.microbatches + layout.pp - 1) * max(plan.stage_layers),
                          allocated_gib=max(s.allocated_gib for s in plan.stages),
                          peak_reserved_gib=plan.peak_memory_gib, capacity_gib=plan.capacity_gib,
                          compiled=recipe.kernels.compile, logits_gib_per_byte=self._logits_gib_per_byte(recipe, layout),
                          context_gib=self.hardware.memory.cuda_context_gib,
                          expandable=recipe.kernels.allocator == "expandable")

    def _logits_gib_per_byte(self, recipe: Recipe, layout: LayoutConfig) -> float:
        chunk = recipe.kernels.loss_chunk_tokens
        tokens = min(layout.max_tokens_per_gpu, chunk) if chunk else layout.max_tokens_per_gpu
        return tokens * self.shape.vocab / layout.tp / 1024 ** 3


def gpu_memory_gb(target: Target) -> float | None:
    """The memory of one device as a card states it; None for a GPU the hardware table knows (it says)."""
    if target.is_cpu:
        return round(_host_memory_gib() * 1024 ** 3 / 1e9, 1)
    return None


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "tuned"
