"""The recipe card: a pydantic model of `recipes/<model>/<gpu>/<name>.yaml`.

Strict on purpose: unknown keys are errors (a misspelt field must not be silently dropped) and
values are not coerced (`tp: "4"` is an error, not 4). `schema/recipe.schema.json` is generated
from these models by `openrecipes card schema`; the field descriptions here are its documentation.
"""

from __future__ import annotations

import datetime
import json
import statistics
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from openrecipes.cards.schema_bounds import plain_value
from openrecipes.config.layout import LayoutConfig, ParallelSizes
from openrecipes.config.recompute_names import RECOMPUTE_GRANULARITIES

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lowercase hex SHA-256")]
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]
Outcome = Literal["pass", "fail"]


class _Strict(BaseModel):
    # NaN and infinity are never a measured number
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    # after each field's own validation, so a nested model has named its own field first (schema_bounds says why)
    _within_bounds = field_validator("*")(plain_value)


class Gpu(_Strict):
    type: Text = Field(description="GPU model as sold, e.g. H200; keys the peak-FLOP/s table")
    memory_gb: Annotated[float, Field(gt=0)]
    count: PosInt = Field(description="GPUs of the run; must equal tp·pp·cp·dp")
    per_node: PosInt
    instance: str | None = Field(default=None, description="cloud instance type; keys the price table")
    peak_bf16_dense_flops: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="peak dense bf16 FLOP/s of one GPU, for a GPU the hardware table does not know")


class Author(_Strict):
    name: Text
    url: str | None = None


class Stack(_Strict):
    """Software versions of the measured run, each as free text with its provenance."""

    framework: Text
    megatron_lm: str | None = None
    transformer_engine: str | None = None
    pytorch: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    flash_attn: str | None = None
    deepep: str | None = None
    python: str | None = None
    network: str | None = None
    source: str | None = Field(default=None, description="how the versions were established")


class DatasetBuild(_Strict):
    """How the fixed-length rows were made from the source conversations."""

    name: Text
    tokenizer: Text
    loss_mask: Text
    rows: PosInt
    row_tokens: PosInt
    padding_tokens: NonNegInt
    seed: int
    packing: Text
    template_kwargs: str | None = None
    supervised_token_ratio: Annotated[float, Field(gt=0, le=1)]
    skipped_invalid: dict[str, NonNegInt] | None = Field(
        default=None, description="conversations the build skipped as invalid, counted by reason (--skip-invalid)")
    tokens_in_unsupervised_rows: NonNegInt | None = Field(
        default=None, description="tokens in rows the build skipped for holding no supervised token")
    parquet_sha256: Sha256
    parquet_bytes: PosInt
    builder: Text


class Dataset(_Strict):
    name: Text
    source: Text
    revision: str | None = Field(default=None, description="pinned 40-hex revision for verified cards")
    license: str | None = None
    rows_sha256: Sha256 = Field(description="hash over the rows' token ids and loss masks")
    build: DatasetBuild | None = None


class Workload(_Strict):
    row_tokens: PosInt = Field(description="tokens per fixed-length row")
    rows: Text = Field(description="what a row holds, e.g. SFT conversations")
    global_batch: PosInt = Field(description="rows per optimizer step")
    precision: Literal["bf16", "fp16", "fp32", "fp8"]
    workflow: Literal["pretrain", "sft", "long-context-sft", "lora"] | None = Field(
        default=None, description="training workflow (the verification cards' names); the site filters on it"
    )
    modality: Literal["text", "image-text"] = Field(
        default="text", description="what the rows hold: text, or text with images (rows built with an image "
                                    "processor); the site filters on it")
    dataset: Dataset


class LayerSplit(_Strict):
    """Decoder layers on the first and last pipeline stages; the middle stages share the rest evenly."""

    first: PosInt
    last: PosInt


class Recompute(_Strict):
    """What each decoder layer recomputes (the recipe's ``recompute``; docs/train.md)."""

    granularity: Literal[tuple(name for name in RECOMPUTE_GRANULARITIES if name != "none")]  # "none": no section
    method: Literal["uniform", "block"] | None = None
    num_layers: PosInt | None = None


class Offload(_Strict):
    optimizer_fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        description="share of optimizer-state elements kept in CPU memory"
    )
    overlap_d2h_h2d: bool


class Layout(_Strict, ParallelSizes):
    """The recipe's parallel sizes (``openrecipes.config.layout.ParallelSizes``) and how the card describes them."""

    label: Text
    summary: Text
    highlights: str | None = None
    layer_split: LayerSplit | None = None
    max_tokens_per_gpu: PosInt | None = None
    rows_per_microbatch: PosInt
    recompute: Recompute | None = None
    offload: Offload | None = None
    dispatcher: Text

    def layout_config(self, row_tokens: int) -> LayoutConfig:
        """The recipe layout this card describes; without ``max_tokens_per_gpu``, the tokens its microbatches
        hold on each cp rank."""
        split = self.layer_split
        return LayoutConfig(
            **{name: getattr(self, name) for name in ParallelSizes.model_fields},
            pp_first_stage_layers=split.first if split else None, pp_last_stage_layers=split.last if split else None,
            max_tokens_per_gpu=self.max_tokens_per_gpu or -(-self.rows_per_microbatch * row_tokens // self.cp),
            rows_per_microbatch=self.rows_per_microbatch)


class ActiveParams(_Strict):
    count: PosInt = Field(
        description="N: active parameters per token, excluding the input embedding and all norms"
    )
    source: Text
    revision: str | None = None


class Result(_Strict):
    tokens_per_s_per_gpu: Annotated[float, Field(gt=0)] = Field(
        description="window tokens / window time / GPUs"
    )
    usd_per_million_tokens: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="USD per GPU-hour / (tokens/s/GPU · 3600) · 1e6"
    )
    usd_per_gpu_hour: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="the price behind usd_per_million_tokens, when the card states it"
    )
    step_time_cv_percent: Annotated[float, Field(ge=0)]
    mfu: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None, description="6 · N · tokens/s/GPU / peak bf16 dense FLOP/s of the GPU"
    )
    mfu_note: str | None = None
    active_params: ActiveParams
    measured: datetime.date
    steps_per_run: PosInt
    window: Annotated[list[NonNegInt], Field(min_length=2, max_length=2)] = Field(
        description="first and last step of the measurement window, inclusive"
    )
    window_tokens: PosInt = Field(description="(window end − start + 1) · global_batch · row_tokens")
    runs: PosInt
    profiler: bool
    gpu_hours: Annotated[float, Field(ge=0)]
    gpu_hours_note: str | None = None


class ComponentTest(_Strict):
    test: Text
    shape: Text
    gpu: Text
    date: datetime.date
    result: Outcome
    detail: Text
    note: str | None = None


class Convergence(_Strict):
    steps: PosInt
    result: Outcome
    correlation: Annotated[float, Field(ge=-1, le=1)]
    final_loss_difference: Annotated[float, Field(ge=0)] = Field(
        description="relative difference of the final losses, |c − r| / |r|"
    )
    pointwise_failures: NonNegInt
    note: str | None = None


class Correctness(_Strict):
    result: Literal["pass", "fail", "not-run"]
    summary: Text
    reference: Text = Field(description="the recipe the candidate is checked against")
    configuration: Outcome | None = None
    component_tests: list[ComponentTest] = Field(default_factory=list)
    convergence: Convergence | None = None
    rules: str | None = None


class Patch(_Strict):
    path: Text = Field(description="the patch file, relative to the card")
    sha256: Sha256
    description: Text


class CurvePoint(_Strict):
    step: NonNegInt
    loss: float
    step_time_s: Annotated[float, Field(gt=0)] | None = Field(default=None, description="the step's wall time")
    tokens_per_s_per_gpu: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="the step's tokens / its time / GPUs")
    peak_memory_gib: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="the step's peak allocated memory, the largest over ranks")
    peak_memory_gib_per_stage: Annotated[list[Annotated[float, Field(ge=0)]], Field(min_length=1)] | None = Field(
        default=None, description="with pipeline stages: the largest peak over the ranks of each stage, stage 0 "
                                  "first (on CPU the process's peak resident memory)")
    grad_norm: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="the step's gradient norm before clipping (metrics.jsonl grad_norm)")
    lr: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="the learning rate the step's update used (metrics.jsonl lr)")


class Curves(_Strict):
    """Per-step training loss of the convergence check's arms (the candidate's step time, tokens/s/GPU and memory
    with it), for the site's plots."""

    candidate: Annotated[list[CurvePoint], Field(min_length=1)]
    reference: list[CurvePoint] | None = None
    memory_phases_gib: dict[str, Annotated[float, Field(ge=0)]] | None = Field(
        default=None, description="the candidate's memory per stage of a step in the window (rank 0; the run's "
                                  "debug.memory_trace): at its start and the peak of each phase, in order")


# why a trial has no measurement; the last three are a Slurm job's end (scancel, a node lost, preempted)
TrialFailure = Literal["out_of_memory", "timeout", "crash", "non_finite_loss", "refused_layout", "cancelled",
                       "node_fail", "preempted"]


class TuningTrial(_Strict):
    """One trial of `openrecipes tune`: what it changed, what the planner predicted, what was measured."""

    trial: NonNegInt = Field(description="order in which the tuner ran it (0: the starting point)")
    role: Literal["start", "trial", "winner"] = Field(description="the starting point, a trial, or this card's recipe")
    changes: Text = Field(description="the performance-only fields changed against the starting point")
    predicted_tokens_per_s_per_gpu: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="the planner's prediction when the trial was chosen (refitted on earlier trials)")
    measured_tokens_per_s_per_gpu: Annotated[float, Field(gt=0)] | None = None
    failure: TrialFailure | None = Field(default=None, description="why the trial has no measurement")
    wall_s: Annotated[float, Field(ge=0)] | None = Field(default=None, description="the trial's wall time")
    overhead_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="its wall time beyond its measured steps (build, host buffers, compile, exit)")

    @model_validator(mode="after")
    def _measured_or_failed(self) -> "TuningTrial":
        if (self.measured_tokens_per_s_per_gpu is None) == (self.failure is None):
            raise ValueError("a trial has either a measured throughput or a failure class, not both or neither")
        return self


class TuningGain(_Strict):
    """The start and the winner measured again in turns: the gain as a median with its spread."""

    start_tokens_per_s_per_gpu: Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=1)] = Field(
        description="the start's samples: its trial, then each remeasurement")
    winner_tokens_per_s_per_gpu: Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=1)]
    pair_gains: Annotated[list[float], Field(min_length=1)] = Field(
        description="winner / start - 1 of each interleaved pair")
    median_gain: float
    start_spread: Annotated[float, Field(ge=0)] = Field(description="(max - min) / median of the start's samples")

    @model_validator(mode="after")
    def _consistent(self) -> "TuningGain":
        if not (len(self.start_tokens_per_s_per_gpu) == len(self.winner_tokens_per_s_per_gpu) == len(self.pair_gains)):
            raise ValueError("pair_gains needs one start and one winner sample per pair")
        pairs = [w / s - 1 for s, w in zip(self.start_tokens_per_s_per_gpu, self.winner_tokens_per_s_per_gpu)]
        if any(abs(g - p) > 1e-6 for g, p in zip(self.pair_gains, pairs)):
            raise ValueError("pair_gains do not follow from the samples (winner / start - 1)")
        if abs(self.median_gain - statistics.median(pairs)) > 1e-6:
            raise ValueError("median_gain is not the median of pair_gains")
        return self

    def describe(self) -> str:
        """The gain in the words the console, the card's notes and the site all use."""
        low, high = min(self.pair_gains), max(self.pair_gains)
        return (f"{self.median_gain:+.1%} (median of {len(self.pair_gains)} interleaved start/winner pairs, from "
                f"{low:+.1%} to {high:+.1%}; the start's own spread {self.start_spread:.1%})")


class TuningAblation(_Strict):
    """The winner with one changed knob set back to the start's, measured once."""

    knob: Text
    measured_tokens_per_s_per_gpu: Annotated[float, Field(gt=0)] | None = None
    contribution: float | None = Field(default=None, description="winner median / this run - 1")
    note: str = ""


class TuningReference(_Strict):
    """A starting point that did not fit the device, and the reference the tuner measured as its start instead: the
    smallest change of its memory knobs predicted to fit (docs/tune.md)."""

    start: Text = Field(description="the starting recipe given to the tuner")
    start_predicted_peak_gib: Annotated[float, Field(gt=0)] = Field(description="its predicted peak, what must fit")
    start_failure: Literal["out_of_memory"] | None = Field(
        default=None, description="its trial's failure when it was run; none: predicted not to fit and never run")
    capacity_gib: Annotated[float, Field(gt=0)] = Field(description="one device's memory the tuner planned against")
    margin: Annotated[float, Field(ge=0, lt=1)] = Field(description="the share of it a candidate leaves free")
    changes: Text = Field(description="the reference's changes against the starting point (its trial's changes)")
    predicted_peak_gib: Annotated[float, Field(gt=0)] = Field(description="the reference's predicted peak")


class TuningScreenRank(_Strict):
    """One rank of a screened candidate, measured alone (`openrecipes measure-rank`'s figures)."""

    rank: NonNegInt
    stage: NonNegInt = Field(description="its pipeline stage")
    peak_gib: Annotated[float, Field(ge=0)] = Field(description="its peak memory (the screen's `peak` says which)")
    compute_s: Annotated[float, Field(ge=0)] = Field(
        description="forward and backward of every microbatch of a step, without communication")
    optimizer_s: Annotated[float, Field(ge=0)] = Field(description="its optimizer step")


class TuningScreened(_Strict):
    """A candidate screened by its ranks measured alone: pruned when the heaviest does not fit."""

    changes: Text = Field(description="the performance-only fields changed against the starting point")
    layout: Text
    fits: bool = Field(description="whether its heaviest measured rank fits with the memory margin free")
    reason: Text | None = Field(default=None, description="why it was pruned (set exactly when it does not fit)")
    trial: NonNegInt | None = Field(default=None, description="the trial it later ran as on the whole fleet, if any")
    ranks: Annotated[list[TuningScreenRank], Field(min_length=1)]

    @model_validator(mode="after")
    def _reason_when_pruned(self) -> "TuningScreened":
        if (self.reason is None) != self.fits:
            raise ValueError("a screened candidate has a reason exactly when it does not fit")
        if not self.fits and self.trial is not None:
            raise ValueError("a candidate pruned by the screen runs no trial")
        return self


class TuningScreen(_Strict):
    """Figures measured on ONE rank at a time on the tuning machine under a fake process group (`openrecipes tune
    --screen`, docs/tune.md): memory and compute without communication. Every other figure of the card (the
    trials, the result) was measured on the whole fleet; none of these is one of them."""

    measured_on: Literal["one rank"] = Field(description="always one rank alone, never the fleet")
    world_size: PosInt = Field(description="the fleet each rank was built as one of")
    device: Text = Field(description="where the ranks were measured (cpu, cuda:0)")
    peak: Literal["cuda_reserved", "process_resident"] = Field(
        description="what peak_gib is: the CUDA allocator's reserved peak, or on CPU the process's resident peak")
    capacity_gib: Annotated[float, Field(gt=0)] = Field(description="one device's memory the peaks must fit")
    margin: Annotated[float, Field(ge=0, lt=1)] = Field(description="the share of it left free")
    candidates: Annotated[list[TuningScreened], Field(min_length=1)]


class Tuning(_Strict):
    """How `openrecipes tune` reached this recipe from a starting point (docs/tune.md)."""

    start_tokens_per_s_per_gpu: Annotated[float, Field(gt=0)]
    tuned_tokens_per_s_per_gpu: Annotated[float, Field(gt=0)]
    minutes: Annotated[float, Field(ge=0)] = Field(description="wall time of the command up to the card")
    pruned: NonNegInt = Field(description="candidates left out without a trial (the planner, the layout rules, "
                                          "a failed trial's kind; pruned.jsonl of the tuning output gives each reason)")
    trials: Annotated[list[TuningTrial], Field(min_length=1)]
    gain: TuningGain | None = None
    ablations: list[TuningAblation] = Field(default_factory=list)
    reference: TuningReference | None = Field(
        default=None, description="set when the starting point did not fit: the trial of role start, and every "
                                  "start figure above, is then this reference's")
    screen: TuningScreen | None = Field(
        default=None, description="with --screen: candidates measured one rank at a time before any trial")


class RecipeCard(_Strict):
    """One recipe: model, fleet, layout, what it measured and how it was verified."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, allow_inf_nan=False, title="OpenRecipes recipe card",
    )

    schema_version: Literal[1]
    model: Text = Field(description="model name as published, e.g. Qwen3-30B-A3B")
    gpu: Gpu
    author: Author
    status: Literal["verified", "unverified"]
    stack: Stack
    workload: Workload
    layout: Layout
    result: Result
    correctness: Correctness
    env: dict[str, str] = Field(default_factory=dict, description="environment variables of the run")
    patches: list[Patch] = Field(default_factory=list)
    run: str = Field(description="the exact command script that reproduces the run")
    recipe: str | None = Field(default=None, description="the resolved recipe the run trained (its recipe.yaml), "
                                                         "for openrecipes' own cards")
    notes: str | None = None
    curves: Curves | None = None
    tuning: Tuning | None = Field(default=None, description="the trials of `openrecipes tune`, when it wrote the card")


def card_json_schema() -> dict[str, Any]:
    schema = RecipeCard.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def card_json_schema_text() -> str:
    """The exact text of `schema/recipe.schema.json`."""
    return json.dumps(card_json_schema(), indent=2, ensure_ascii=False) + "\n"
