"""The recipe: one config tree, loaded from YAML, overridable with ``--set a.b=c``.

Every section forbids unknown keys, so a misspelt key is an error that names it. The resolved tree is written
to the run directory as ``recipe.yaml`` and embedded in the recipe card.
"""

from __future__ import annotations

import difflib
import math
import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from openrecipes.config.epochs import MAX_STEPS, epochs_into_steps
from openrecipes.config.hf_names import hf_name_hint, peft_name_hint
from openrecipes.config.kernel_names import AttentionBackend, ExpertBackend
from openrecipes.config.recompute_names import RecomputeGranularity
from openrecipes.config.numbers import NumbersNotBooleans
from openrecipes.config.overrides import apply_overrides
from openrecipes.config.layout import LayoutConfig, LayoutError, compile_problem

# inf and nan are never a setting: `lr: .inf` or `1e400` would turn every weight into NaN at the first step
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
# bounds past any real recipe, so a mistyped size is refused by its field rather than failing deep in a run: rows
# in a batch or a build (16 M), tokens in a row (16 M), and a seed torch.manual_seed takes (a signed 64-bit value)
MAX_ROWS = 1 << 24
MAX_ROW_TOKENS = 1 << 24
MAX_SEED = 2**63 - 1
# what the row builder itself hands a chat template (the conversation, its tools, the special tokens, the generation
# prompt) and jinja's own namespace(): a recipe's or --template-kwargs' variable of these names is refused
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                            "namespace")
_Beta = Annotated[float, Field(ge=0, lt=1)]


# how data build reads a chat dataset (data/chat_input.py takes its choices from these)
ChatInputShape = Literal["openai", "sharegpt"]
ChatRole = Literal["system", "user", "assistant", "tool"]
# text: a quoted added token is text, but the markers the chat format gives meaning to in a reply (loss-mask format
# ``reply_markers``: Qwen3's <think>, <tool_call> and their closers) keep their ids in an assistant's content, as
# apply_chat_template renders them; refuse: a conversation quoting any other added token is refused;
# text_everywhere: every quoted added token is text, a reply's markers too (docs/data.md)
SpecialTokensInText = Literal["text", "refuse", "text_everywhere"]
TooLong = Literal["skip", "truncate"]  # what a conversation over max_conversation_tokens gets
# the loss-mask formats (sft): data/templates.py's LOSS_MASKS defines one for each of these names
LossMaskName = Literal["qwen3", "qwen3_miles", "muse_spark", "gpt_oss", "glm4"]


class DataBuild(NumbersNotBooleans):
    """Rows built at the start of the run (into RUN_DIR/rows) with `openrecipes data build` semantics."""

    model_config = _STRICT
    # sft: conversations, only assistant turns supervised; pretrain: documents (text or a Megatron indexed
    # dataset), every target within a document supervised (docs/data.md)
    format: Literal["sft", "pretrain"] = "sft"
    input: str = "bundled"          # "bundled": the conversations (sft) or documents (pretrain) that ship with openrecipes
    tokenizer: str = "bundled"
    loss_mask: LossMaskName = "qwen3"  # sft only
    row_tokens: int = Field(..., ge=1, le=MAX_ROW_TOKENS)
    rows: int | None = Field(None, ge=1, le=MAX_ROWS)
    seed: int = Field(42, ge=0, le=MAX_SEED)
    # sft only: extra template variables: strings, booleans, lists of strings (gpt-oss's builtin_tools)
    template_kwargs: dict[str, str | StrictBool | list[str]] = Field(default_factory=dict)
    chat_template: str | None = None  # sft only: a built-in name (qwen3, muse_spark) or file instead of the tokenizer's
    eos_token: str | None = None      # the token after each document (default: the format's, see docs/data.md)
    # sft only: a conversation of more tokens than this is skipped (counted) or truncated (docs/data.md)
    max_conversation_tokens: int | None = Field(None, ge=1)
    too_long: TooLong = "skip"
    # sft only: the dataset's shape (openai role/content, or sharegpt from/value), the key holding each
    # conversation (default messages, or conversations for sharegpt), and roles renamed before the check
    input_shape: ChatInputShape = "openai"
    messages_field: str | None = Field(None, min_length=1)
    role_map: dict[str, ChatRole] = Field(default_factory=dict)
    # a special token inside a conversation's or document's own text: tokenized as text, or the input refused
    special_tokens_in_text: SpecialTokensInText = "text"
    # sft only: image parts of the conversations are read, resized as this preprocessor_config.json (or a directory
    # holding one; "bundled": the bundled image-text set's) says; null: image parts are refused (docs/data.md)
    image_processor: str | None = None

    @field_validator("template_kwargs")
    @classmethod
    def _not_the_builders(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise ValueError(f"{', '.join(map(repr, reserved))} is set by the builder and cannot be overridden")
        return kwargs

    @model_validator(mode="after")
    def _sft_fields_only_for_sft(self) -> "DataBuild":
        # by value, not by "was it written": the run directory's recipe.yaml spells out every default
        given = [name for name in ("loss_mask", "template_kwargs", "chat_template", "max_conversation_tokens",
                                   "too_long", "input_shape", "messages_field", "role_map", "image_processor")
                 if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)]
        if self.format == "pretrain" and given:
            raise ValueError(f"{', '.join(given)} apply to format sft only: pretraining rows supervise every "
                             "target within a document")
        if self.too_long != "skip" and self.max_conversation_tokens is None:
            raise ValueError(f"too_long: {self.too_long} needs max_conversation_tokens (the limit it applies to)")
        return self


def data_build_flag(field: str) -> str:
    """The ``data build`` flag of a ``DataBuild`` field: the flags are the keys (``row_tokens``: ``--row-tokens``)."""
    return "--" + field.replace("_", "-")


class Data(NumbersNotBooleans):
    model_config = _STRICT
    rows: str | None = None          # a directory written by `openrecipes data build`
    build: DataBuild | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "Data":
        if (self.rows is None) == (self.build is None):
            raise ValueError("give exactly one of data.rows (a built rows directory) or data.build")
        return self


class Recompute(NumbersNotBooleans):
    """What each decoder layer recomputes in the backward, and which layers (parallel/recompute.py)."""

    model_config = _STRICT
    granularity: RecomputeGranularity = "none"
    method: Literal["uniform", "block"] = "uniform"  # uniform: every layer; block: the first num_layers layers
    num_layers: int = Field(1, ge=1)


class Optimizer(NumbersNotBooleans):
    model_config = _STRICT
    name: Literal["adam"] = "adam"
    # bounds far outside any sensible value, so a typo (1e3 for 1e-3) is refused rather than trained on
    lr: float = Field(1e-5, gt=0, le=1)
    min_lr: float = Field(0.0, ge=0)
    betas: tuple[_Beta, _Beta] = (0.9, 0.98)
    eps: float = Field(1e-8, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    warmup_fraction: float = Field(0.0, ge=0, le=1)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    grad_clip: float | None = Field(1.0, gt=0)
    precision_aware: StrictBool = False     # bf16 params + (remainders | fp32 masters), moments in moment_dtype
    param_remainders: StrictBool = True     # with precision_aware: int16 remainders instead of fp32 masters
    moment_dtype: Literal["fp32", "bf16"] = "fp32"

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> "Optimizer":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) is larger than lr ({self.lr})")
        return self


class Moe(NumbersNotBooleans):
    """Mixture-of-experts training terms (Megatron's ``moe_*`` arguments)."""

    model_config = _STRICT
    # weight of the router load-balancing loss (transformers' router_aux_loss_coef, Megatron's moe_aux_loss_coeff),
    # computed as transformers computes it for Qwen3-MoE (models/common/router_loss.py); 0 turns it off
    aux_loss_coef: float = Field(0.0, ge=0, le=1)


class Mtp(NumbersNotBooleans):
    """Multi-token prediction (DeepSeek-V3 report §2.2, Megatron-LM's ``mtp_*`` arguments): the model's MTP layers
    (``num_nextn_predict_layers`` of them) are kept and trained, their loss added to the objective (docs/models.md)."""

    model_config = _STRICT
    # lambda: the objective is the main loss + loss_weight / depths * (sum of the depths' per-token losses); the
    # report trains with 0.3, then 0.1 for its last tokens; 0.1 is Megatron-LM's mtp_loss_scaling_factor default
    loss_weight: float = Field(0.1, gt=0)


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "experts", "latent_down_proj", "latent_up_proj",
                     "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]


class Lora(NumbersNotBooleans):
    """LoRA fine-tuning (models/common/lora.py): the base is frozen, only the adapters train (docs/lora.md)."""

    model_config = _STRICT
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # attention projections, every routed expert's projections (one adapter per expert), Muse Spark's latent
    # projections (the seed's fc1_latent_proj / fc2_latent_proj), Qwen3.5-MoE's linear-attention projections
    targets: list[LoraTarget] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)

    @model_validator(mode="after")
    def _no_dropout_on_experts(self) -> "Lora":
        if "experts" in self.targets and self.dropout:
            raise ValueError("dropout must be 0 with the experts target (the expert adapters change the grouped "
                             "weights, where dropout of the input is not defined; PEFT refuses it too)")
        return self


class Fp8(NumbersNotBooleans):
    """FP8 matrix products (models/common/fp8.py): weights, gradients and the optimizer keep ``precision``'s dtypes;
    the products of ``targets`` read e4m3 operands scaled by ``scaling`` (row-wise: one scale per row along the
    summed dimension). ``experts``: the routed experts' grouped products; ``projections``: every other linear layer
    of the decoder layers (attention, dense MLPs, shared experts); the LM head and the routers stay in bf16."""

    model_config = _STRICT
    scaling: Literal["rowwise"] = "rowwise"
    targets: list[Literal["experts", "projections"]] = Field(
        default_factory=lambda: ["experts", "projections"], min_length=1)


class Vision(NumbersNotBooleans):
    """A model that takes images (its family declares ``images``): its vision towers are always frozen (no gradients,
    no optimizer state); the projection of their features into the decoder trains unless this says otherwise."""

    model_config = _STRICT
    train_projection: StrictBool = True


class Offload(NumbersNotBooleans):
    model_config = _STRICT
    fraction: float = Field(0.0, ge=0, le=1)  # share of the optimizer state kept and updated on the CPU
    overlap: StrictBool = True
    # where the offloaded state is updated: streamed through the GPU (device) or by the CPU (host)
    update: Literal["device", "host"] = "device"
    activations: StrictBool = False  # what decoder layers save for the backward waits in host memory


class Checkpoint(NumbersNotBooleans):
    model_config = _STRICT
    every: int | None = Field(None, ge=1)   # steps between saves; the last step is always saved
    keep: int = Field(2, ge=1)               # newest checkpoints kept
    at_end: StrictBool = True                      # save after the last step (benchmarks turn it off)
    export_hf: StrictBool = False                  # after the last step, export that save to RUN_DIR/hf (Hugging Face)

    @model_validator(mode="after")
    def _export_reads_the_last_save(self) -> "Checkpoint":
        if self.export_hf and not self.at_end:
            raise ValueError("export_hf needs at_end: true (the export reads the save of the last step)")
        return self


class Logging(NumbersNotBooleans):
    model_config = _STRICT
    progress: StrictBool = True
    tensorboard: StrictBool = False
    wandb: StrictBool = False
    wandb_project: str = "openrecipes"


class Kernels(NumbersNotBooleans):
    model_config = _STRICT
    attention: AttentionBackend = "auto"
    experts: ExpertBackend = "auto"
    # torch.compile of each layer's attention and MoE blocks (fused element-wise work, fewer launches)
    compile: StrictBool = False
    # > 0: the LM head and the loss run this many tokens at a time, never holding all the logits (train/chunked_loss.py)
    loss_chunk_tokens: int = Field(0, ge=0)
    # the CUDA caching allocator's segments: "expandable" grows one mapping in place, so freed blocks of odd sizes do
    # not strand device memory (on one H200 the 22-layer start's compiled 4-row microbatch ran without optimizer
    # offload only so, at the same speed: BENCHMARKS.md, call d); "caching": fixed-size segments, torch's default
    allocator: Literal["expandable", "caching"] = "expandable"


class Debug(NumbersNotBooleans):
    model_config = _STRICT
    force_load_balance: StrictBool = False   # route tokens round-robin over experts (benchmarks only)
    skip_nonfinite_steps: StrictBool = False  # skip an update with a non-finite loss or grad norm instead of stopping
    profile_step: int | None = Field(None, ge=0)  # run this step under torch.profiler; its table goes to profile.txt
    profile_sort: str | None = None     # the profile table's sort key (default: cuda_time_total, or cpu_time_total)
    profile_timeline: StrictBool = False      # with profile_step: also the step's Chrome trace (profile_trace.json)
    memory_trace: StrictBool = False          # CUDA: record each rank-0 step's memory per phase (memory_phases_gib)
    fail_at: tuple[int, int] | None = None  # [RANK, STEP]: that rank raises at that step (tests of the launcher)
    stall_at: tuple[int, int] | None = None  # [RANK, STEP]: that rank hangs after that step (tests of the heartbeat)
    max_consecutive_skips: int = Field(3, ge=1)  # with skip_nonfinite_steps: stop after this many skips in a row

    @model_validator(mode="after")
    def _timeline_of_a_profiled_step(self) -> "Debug":
        if self.profile_timeline and self.profile_step is None:
            raise ValueError("profile_timeline: true needs profile_step (the step whose timeline it writes)")
        return self


class Recipe(NumbersNotBooleans):
    model_config = _STRICT
    name: str = "run"
    model: str                                  # registry name or Hugging Face checkpoint directory
    model_overrides: dict[str, Any] = Field(default_factory=dict)  # e.g. {num_hidden_layers: 8}
    init: Literal["random", "checkpoint"] = "random"  # checkpoint: load the weights of `model` (an HF dir)
    data: Data
    layout: LayoutConfig
    recompute: Recompute = Field(default_factory=Recompute)
    optimizer: Optimizer = Field(default_factory=Optimizer)
    moe: Moe = Field(default_factory=Moe)
    mtp: Mtp | None = None                      # train the model's multi-token-prediction layers
    lora: Lora | None = None                    # train LoRA adapters on a frozen base
    vision: Vision = Field(default_factory=Vision)  # image models: what of the vision side trains
    offload: Offload = Field(default_factory=Offload)
    precision: Literal["bf16", "fp32"] = "bf16"
    fp8: Fp8 | None = None                      # FP8 products on top of bf16 (the card says precision fp8)
    steps: int = Field(..., ge=1, le=MAX_STEPS)
    # passes over data.build.rows instead of steps, turned into steps on load (config/epochs.py)
    epochs: float | None = Field(None, gt=0)
    global_batch: int = Field(..., ge=1, le=MAX_ROWS)       # rows per optimizer step
    seed: int = Field(0, ge=0, le=MAX_SEED)
    # a collective waiting longer ends the job (a week at most: what a timer of the process group can hold)
    distributed_timeout_minutes: float = Field(10.0, gt=0, le=7 * 24 * 60)
    # a rank that makes no progress between two steps for longer ends the job (train/heartbeat.py); null: never
    heartbeat_timeout_seconds: float | None = Field(300.0, gt=0)
    run_dir: str = "runs/run"
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    logging: Logging = Field(default_factory=Logging)
    kernels: Kernels = Field(default_factory=Kernels)
    debug: Debug = Field(default_factory=Debug)

    @model_validator(mode="before")
    @classmethod
    def _checked_tree(cls, tree: Any) -> Any:
        # a NUL (YAML's "\0") in a path made the system's one-line error name no field
        key = _first_key(tree, lambda leaf: isinstance(leaf, str) and "\0" in leaf)
        if key is not None:
            raise ValueError(f"{key}: holds a NUL character, which no path or name may hold")
        return epochs_into_steps(tree)

    @field_validator("model_overrides")
    @classmethod
    def _overrides_are_finite(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Any escapes allow_inf_nan: `rope_theta: .inf` would train, be written to recipe.yaml as null and leave a
        # run that can neither resume nor export
        key = _nonfinite_key(value)
        if key is not None:
            raise ValueError(f"{key}: not a finite number (inf and nan are never a setting)")
        return value

    @field_validator("run_dir")
    @classmethod
    def _run_dir_names_a_directory(cls, value: str) -> str:
        # '' and '.' would write rows, checkpoints and metrics straight into the working directory, and '..', '../..'
        # or '/' into one that holds it (train also refuses such a directory named another way: rundir.claim_run_dir)
        parts = Path(os.path.normpath(value)).parts if value.strip() else ()
        if not parts or parts == (".",) or all(part == ".." for part in parts) or parts == (Path(value).anchor,):
            raise ValueError("must name a directory for the run (it is created), not '', the working directory or "
                             "one above it ('..', '/')")
        if len(value) > 4000 or any(len(part.encode()) > 255 for part in Path(value).parts):
            raise ValueError("too long for a path (at most 255 bytes a name, 4,000 characters in all)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        if self.precision == "fp32" and self.optimizer.precision_aware:
            raise ValueError("optimizer.precision_aware needs precision: bf16")
        if self.offload.fraction and self.precision == "fp32":
            raise ValueError("offload.fraction needs precision: bf16 (fp32 training keeps its state on the device)")
        if self.fp8 is not None and (self.precision != "bf16" or self.lora is not None or self.layout.tp > 1):
            raise ValueError("fp8: needs precision bf16, no lora and layout.tp 1 (tensor-parallel shards and "
                             "adapters are not FP8 products yet)")
        compile_refused = compile_problem(self.layout, self.kernels.compile)
        if compile_refused:
            raise LayoutError(compile_refused)
        if self.recompute.method == "uniform" and self.recompute.num_layers != 1:
            raise ValueError("recompute.num_layers: only 1 is supported with method uniform (every layer is "
                             "recomputed); method block recomputes the first num_layers layers")
        return self

    def card_precision(self) -> str:
        """The precision a card states: fp8 where the recipe's products run in FP8, else the weights' dtype."""
        return "fp8" if self.fp8 is not None else self.precision

    def compute_dtype(self) -> Any:
        """The torch dtype the model computes in (and keeps its weights in under LoRA): bf16 or fp32."""
        import torch  # the config tree itself stays free of torch

        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    def optimizer_master(self) -> str:
        if self.precision == "fp32":
            return "param"
        return "remainder" if self.optimizer.precision_aware and self.optimizer.param_remainders else "fp32"


def _nonfinite_key(value: Any) -> str | None:
    """The dotted key of the first inf or nan inside ``value`` (mappings and lists searched), or None."""
    return _first_key(value, lambda leaf: isinstance(leaf, float) and not math.isfinite(leaf))


def _first_key(value: Any, bad: Any, path: str = "") -> str | None:
    """The dotted key of the first leaf inside ``value`` (mappings and lists searched) that ``bad`` holds, or None."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else None
    if items is None:
        return path if bad(value) else None
    for key, item in items:
        found = _first_key(item, bad, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _section_keys(loc: tuple) -> list[str]:
    """The keys the recipe section at ``loc`` (a path of field names) accepts; [] when it is not a section."""
    model: Any = Recipe
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        candidates = [field.annotation, *typing.get_args(field.annotation)]  # X, or X | None
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)


def _format_error(error: ValidationError, source: str) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        hint = ""
        if item["type"] == "extra_forbidden":  # another tool's name for a setting, or a misspelt key
            hf_hint = hf_name_hint(str(item["loc"][-1])) or peft_name_hint(item["loc"][:-1], str(item["loc"][-1]))
            close = difflib.get_close_matches(str(item["loc"][-1]), _section_keys(item["loc"][:-1]), n=1, cutoff=0.6)
            hint = f" ({hf_hint})" if hf_hint else f" (did you mean '{close[0]}'?)" if close else ""
        message = item["msg"].removeprefix("Value error, ")  # pydantic's wrapper of a validator's own message
        lines.append(f"{source}: {where}: {message}{hint}")
    return "\n".join(lines)


def recipe_from_dict(tree: dict, *, source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(tree)
    except ValidationError as error:
        raise ValueError(_format_error(error, source)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    from openrecipes.config.safe_yaml import load_plain_yaml_file

    tree, _, _ = load_plain_yaml_file(path)
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: a recipe must be a YAML mapping")
    return recipe_from_dict(apply_overrides(tree, overrides or []), source=str(path))


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
