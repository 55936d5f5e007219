"""The verification card: a pydantic model of `verification/<model>.yaml`.

A recipe card answers "how fast is this layout"; a verification card answers "does this model work in this workflow,
and what should I see". It holds one item per recorded combination of workflow, hardware, precision and layout, each
with its status, the exact command, the resolved recipe, the recorded metrics and the observed result. Strict like the
recipe card (unknown keys and coerced values are errors); `schema/verification.schema.json` is generated from it by
`openrecipes card schema --kind verification`.
"""

from __future__ import annotations

import datetime
import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from openrecipes.cards.schema import CurvePoint, NonNegInt, PosInt, Sha256, Stack, Text, _Strict

WORKFLOWS = ("import", "export", "pretrain", "sft", "long-context-sft", "lora", "image-text")
Workflow = Literal["import", "export", "pretrain", "sft", "long-context-sft", "lora", "image-text"]
TRAINING_WORKFLOWS = frozenset(WORKFLOWS) - {"import", "export"}
Precision = Literal["bf16", "fp16", "fp32", "fp8"]
Positive = Annotated[float, Field(gt=0)]


class Hardware(_Strict):
    type: Text = Field(description="GPU model as sold (H200, GB200) or cpu; with precision and layout, keys the item")
    count: PosInt = Field(description="GPUs (or CPU processes) of the run")
    per_node: PosInt | None = None


class ItemLayout(_Strict):
    """The parallel layout as the item is selected by; sizes where the engine states them."""

    label: Text = Field(description="the layout as shown in the selector, e.g. TP1 PP1 EP1 DP1")
    tp: PosInt | None = None
    pp: PosInt | None = None
    cp: PosInt | None = None
    ep: PosInt | None = None
    etp: PosInt | None = None
    dp: PosInt | None = None


class ItemMetrics(_Strict):
    """What the run recorded. Every number must follow from the others and from the loss curve (`card validate`)."""

    steps: PosInt = Field(description="optimizer-step records of the run")
    initial_loss: float | None = Field(default=None, description="loss of the first step")
    final_loss: float | None = Field(default=None, description="loss of the last step")
    window: Annotated[list[NonNegInt], Field(min_length=2, max_length=2)] | None = Field(
        default=None, description="first and last step of the timing window, inclusive: the last 10 steps")
    window_tokens: PosInt | None = Field(default=None, description="tokens trained in the window, all GPUs")
    step_time_ms: Positive | None = Field(default=None, description="mean step time over the window")
    model_tflops_per_gpu: Positive | None = Field(
        default=None, description="model FLOPs (6·N per token plus causal attention) / window time / GPUs")
    tokens_per_s_per_gpu: Positive | None = Field(default=None, description="window tokens / window time / GPUs")
    active_params: PosInt | None = Field(default=None, description="N: active parameters per token")
    peak_memory_gib_per_stage: list[Annotated[float, Field(ge=0)]] | None = Field(
        default=None, description="peak allocated memory of each pipeline stage, the largest over its ranks (with one "
                                  "stage null on CPU; with more, on CPU the peak resident memory of the processes)")
    skipped_steps: NonNegInt = Field(description="steps whose update was not applied")
    nan_steps: NonNegInt = Field(description="steps with a non-finite loss or gradient norm")


class Check(_Strict):
    name: Text = Field(description="what was checked, e.g. checkpoint audit, finite steps")
    result: Literal["pass", "fail"]
    detail: Text


class CheckpointSource(_Strict):
    source: Text = Field(description="a Hugging Face id, a path, or the run that generated it")
    revision: str | None = Field(default=None, description="pinned 40-hex revision of a published checkpoint")
    generated: bool = Field(default=False, description="made by a run, not downloaded: identified by sha256")
    sha256: Sha256 | None = Field(default=None, description="hash over the checkpoint's files (generated ones)")


class DataSource(_Strict):
    source: Text
    revision: str | None = None
    hashes: dict[str, Sha256] = Field(default_factory=dict, description="name -> SHA-256, e.g. rows, parquet")


class Item(_Strict):
    """One recorded combination: workflow x hardware x precision x layout."""

    workflow: Workflow
    hardware: Hardware
    precision: Precision
    layout: ItemLayout
    status: Literal["verified", "unverified"]
    command: str | None = Field(description="the exact command; null when none was recorded (unverified)")
    recipe: str | None = Field(default=None, description="the run's resolved recipe (YAML text)")
    metrics: ItemMetrics | None = None
    loss_curve: list[CurvePoint] | None = Field(default=None, description="finite loss per step")
    checks: list[Check] = Field(default_factory=list)
    observed: Text = Field(description="the observed result, or why there is none")
    stack: Stack | None = None
    checkpoint: CheckpointSource | None = None
    data: DataSource | None = None
    recorded: datetime.date | None = None

    def key(self) -> tuple[str, str, str, str]:
        return (self.workflow, self.hardware.type, self.precision, self.layout.label)


class VerificationCard(_Strict):
    """Every recorded workflow combination of one model."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, allow_inf_nan=False, title="OpenRecipes verification card",
    )

    schema_version: Literal[1]
    kind: Literal["verification"] = Field(description="tells a verification card from a recipe card")
    model: Text = Field(description="model name as published; recipe cards of the same model are linked")
    model_id: Text = Field(description="the registry name or Hugging Face id the commands use")
    description: Text
    engine: Text = Field(default="openrecipes", description="the tool whose commands the items record")
    items: list[Item] = Field(default_factory=list)


def verification_json_schema_text() -> str:
    """The exact text of `schema/verification.schema.json`."""
    schema: dict[str, Any] = VerificationCard.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
