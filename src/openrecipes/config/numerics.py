"""Numerics rules: which recipe fields may change the numbers a run computes, and which only its speed.

Every leaf field of the recipe tree (:class:`openrecipes.config.recipe.Recipe`, walked through its nested
sections) is classified exactly once in ``FIELD_RULES``, with the reason beside it. Two recipes train the
same model the same way when they differ in performance-only fields alone; the tuner changes only those
(:func:`performance_only_fields`), a resumed run may change only those (and ``steps``), and ``verify rules`` compares
recipes with them. A test walks the recipe tree and fails on any field missing here, so a new recipe field has to be
classified before it can be used.

"Performance-only" means the field changes at most the floating-point rounding of the update, never its
math: the global batch, the data order and the per-token loss are the same; a sum may be taken in a
different order (a layout, a kernel) or its operands moved between devices (offload). Whether that
rounding stays small is the job of the convergence check and the optimizer component test.
"""

from __future__ import annotations

import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel

Kind = Literal["numerics", "performance"]
NUMERICS: Kind = "numerics"
PERFORMANCE: Kind = "performance"

_LAYOUT_REASON = ("a layout only regroups the same computation over GPUs: the global batch, the data order and "
                  "the per-token loss do not depend on it; only the order of reductions (rounding) changes")


@dataclass(frozen=True, kw_only=True)
class FieldRule:
    path: str
    kind: Kind
    reason: str


def _rules(kind: Kind, reason: str, *paths: str) -> dict[str, FieldRule]:
    return {path: FieldRule(path=path, kind=kind, reason=reason) for path in paths}


# The one classification of every recipe field. Keys are dotted paths of leaf fields.
FIELD_RULES: dict[str, FieldRule] = {
    **_rules(NUMERICS, "the architecture: which model is trained", "model", "model_overrides"),
    **_rules(NUMERICS, "the initial weights (random from the seed, or loaded)", "init"),
    **_rules(NUMERICS, "the rows trained on: their tokens, loss masks and order", "data.rows"),
    **_rules(NUMERICS, "how the rows are built from conversations: a different value gives different rows",
             "data.build.input", "data.build.tokenizer", "data.build.loss_mask", "data.build.row_tokens",
             "data.build.rows", "data.build.seed", "data.build.template_kwargs", "data.build.chat_template",
             "data.build.format", "data.build.eos_token", "data.build.max_conversation_tokens",
             "data.build.too_long", "data.build.input_shape", "data.build.messages_field", "data.build.role_map",
             "data.build.special_tokens_in_text", "data.build.image_processor"),
    **_rules(NUMERICS, "the dtype of weights and activations, and so the math of every step", "precision"),
    **_rules(NUMERICS, "FP8 products round their operands to e4m3 (3 mantissa bits): other values in every "
             "product they replace", "fp8.scaling", "fp8.targets"),
    **_rules(NUMERICS, "the update rule, its hyperparameters and schedule",
             "optimizer.name", "optimizer.lr", "optimizer.min_lr", "optimizer.betas", "optimizer.eps",
             "optimizer.weight_decay", "optimizer.warmup_fraction", "optimizer.decay", "optimizer.grad_clip"),
    **_rules(NUMERICS, "how master weights and moments are stored (bf16 + remainders, fp32 masters, "
             "bf16 moments) changes the precision of the update itself, not just its rounding order",
             "optimizer.precision_aware", "optimizer.param_remainders", "optimizer.moment_dtype"),
    **_rules(NUMERICS, "the router load-balancing loss is added to the objective: another gradient for every "
             "router and everything below it", "moe.aux_loss_coef"),
    **_rules(NUMERICS, "the multi-token-prediction loss is added to the objective (and its layers trained): another "
             "gradient for the whole model", "mtp.loss_weight"),
    **_rules(NUMERICS, "LoRA: which weights train (adapters on a frozen base), the adapters' rank, scaling "
             "(alpha / rank) and dropout: a different model update", "lora.rank", "lora.alpha", "lora.dropout",
             "lora.targets"),
    **_rules(NUMERICS, "whether the projection of an image model's vision features trains or stays frozen: a "
             "different model update", "vision.train_projection"),
    **_rules(NUMERICS, "the number of updates and, through the schedule, every learning rate", "steps", "epochs"),
    **_rules(NUMERICS, "rows per optimizer step: the gradient is averaged over a different batch", "global_batch"),
    **_rules(NUMERICS, "the random initialisation and any sampling", "seed"),
    **_rules(NUMERICS, "replaces the router's choice of experts with round-robin routing", "debug.force_load_balance"),
    **_rules(NUMERICS, "skipping a non-finite step changes which updates are applied", "debug.skip_nonfinite_steps"),
    **_rules(PERFORMANCE, "observing a step (profiler, memory counters) or stopping a run changes no value computed",
             "debug.profile_step", "debug.profile_sort", "debug.profile_timeline", "debug.memory_trace", "debug.fail_at",
             "debug.stall_at"),
    **_rules(PERFORMANCE, "grouped_mm and the per-expert loop compute the same products; they differ only "
             "in how the matrix multiplies are blocked, i.e. in rounding", "kernels.experts"),
    **_rules(PERFORMANCE, "every attention kernel computes the same causal, document-masked softmax "
             "attention; they differ only in blocking and accumulation order, i.e. in rounding",
             "kernels.attention"),
    **_rules(PERFORMANCE, "torch.compile fuses the same element-wise operations into fewer kernels; only the "
             "rounding of intermediate values kept in registers instead of memory can differ", "kernels.compile"),
    **_rules(PERFORMANCE, "the LM head and cross entropy computed over chunks of tokens are the same products and "
             "the same fp32 loss; only the weight gradient's sum over tokens is blocked differently (rounding)",
             "kernels.loss_chunk_tokens"),
    **_rules(PERFORMANCE, "where the allocator places tensors in device memory; no value changes",
             "kernels.allocator"),
    **_rules(PERFORMANCE, _LAYOUT_REASON, "layout.tp", "layout.pp", "layout.cp", "layout.ep", "layout.etp",
             "layout.dp", "layout.vpp", "layout.sequence_parallel", "layout.pp_first_stage_layers",
             "layout.pp_last_stage_layers"),
    **_rules(PERFORMANCE, "microbatches hold whole rows and gradients accumulate in fp32 over the same global "
             "batch, so the microbatch size changes only the summation order",
             "layout.max_tokens_per_gpu", "layout.rows_per_microbatch"),
    **_rules(PERFORMANCE, "recomputation repeats the same forward pass to save memory",
             "recompute.granularity", "recompute.method", "recompute.num_layers"),
    **_rules(PERFORMANCE, "the same Adam step for part of the state kept in host memory, run on the CPU or "
             "streamed through the GPU; the component test bounds its error", "offload.fraction", "offload.overlap",
             "offload.update"),
    **_rules(PERFORMANCE, "saved activations are copied to host memory and back unchanged: the backward reads the "
             "same values", "offload.activations"),
    **_rules(PERFORMANCE, "when and how many checkpoints are saved; saving reads the state, never changes it",
             "checkpoint.every", "checkpoint.keep", "checkpoint.at_end"),
    **_rules(PERFORMANCE, "the Hugging Face export reads the last save after training; it changes no trained value",
             "checkpoint.export_hf"),
    **_rules(PERFORMANCE, "what is reported, not what is computed", "logging.progress", "logging.tensorboard",
             "logging.wandb", "logging.wandb_project"),
    **_rules(PERFORMANCE, "labels and paths of the run", "name", "run_dir"),
    **_rules(PERFORMANCE, "how long a collective may wait before the job ends", "distributed_timeout_minutes"),
    **_rules(PERFORMANCE, "how long a rank may make no progress between steps before the job ends",
             "heartbeat_timeout_seconds"),
    **_rules(PERFORMANCE, "when a run of skipped non-finite steps ends the job; a finished run applied the same "
             "updates", "debug.max_consecutive_skips"),
}


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes inside an annotation (``X``, ``X | None``, ``Optional[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return [m for arg in typing.get_args(annotation) for m in _section_models(arg)]
    return []


def field_paths(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every leaf field of the recipe tree as a dotted path, recursing through nested sections."""
    if model is None:
        from openrecipes.config.recipe import Recipe

        model = Recipe
    paths: list[str] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        sections = _section_models(info.annotation)
        if sections:
            for section in sections:
                paths.extend(p for p in field_paths(section, f"{path}.") if p not in paths)
        else:
            paths.append(path)
    return paths


def classify(path: str) -> FieldRule:
    """The rule of one leaf field; an unclassified path is an error naming it."""
    try:
        return FIELD_RULES[path]
    except KeyError:
        raise ValueError(f"recipe field {path!r} is not classified in openrecipes.config.numerics.FIELD_RULES") from None


def performance_only_fields() -> tuple[str, ...]:
    """The dotted paths a tuner may change without changing what the run computes."""
    return tuple(sorted(p for p, rule in FIELD_RULES.items() if rule.kind == PERFORMANCE))


def numerics_fields() -> tuple[str, ...]:
    return tuple(sorted(p for p, rule in FIELD_RULES.items() if rule.kind == NUMERICS))


_ABSENT = object()  # a leaf under a section the recipe does not have (e.g. data.build with data.rows)


@dataclass(frozen=True, kw_only=True)
class Difference:
    path: str
    kind: Kind
    candidate: Any
    reference: Any
    reason: str


@dataclass(kw_only=True)
class RulesReport:
    candidate: str
    reference: str
    numerics: list[Difference] = field(default_factory=list)
    performance: list[Difference] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.numerics

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "candidate": self.candidate, "reference": self.reference,
                "numerics": [asdict(d) for d in self.numerics],
                "performance": [asdict(d) for d in self.performance]}


def _lookup(tree: dict[str, Any], path: str) -> tuple[Any, str]:
    """The value at ``path``, or _ABSENT and the path of the section that is missing (null) on the way."""
    node: Any = tree
    parts = path.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT, ".".join(parts[:depth])
        node = node[part]
    return node, path


def compare_recipes(candidate: Any, reference: Any, *, candidate_name: str = "candidate",
                    reference_name: str = "reference", rows_identity: Callable[[Any], Any] = lambda v: v) -> RulesReport:
    """Every leaf field whose value differs between two recipes, split by its classification. ``rows_identity``
    maps a ``data.rows`` value to what identifies its content (two copies of the same rows are the same data)."""
    cand = candidate.model_dump(mode="json")
    ref = reference.model_dump(mode="json")
    report = RulesReport(candidate=candidate_name, reference=reference_name)
    seen: set[str] = set()
    for path in field_paths(type(candidate)):
        rule = classify(path)
        (c_value, c_where), (r_value, r_where) = _lookup(cand, path), _lookup(ref, path)
        same = c_value == r_value
        if not same and path == "data.rows":
            same = rows_identity(c_value) == rows_identity(r_value)
        if same:
            continue
        if c_value is _ABSENT or r_value is _ABSENT:
            # a whole section set on one side only (data.build against data.rows): one line for the section
            section = c_where if c_value is _ABSENT else r_where
            if section in seen:
                continue
            seen.add(section)
            kinds = {classify(p).kind for p in field_paths(type(candidate)) if p.startswith(section + ".")}
            kind = NUMERICS if NUMERICS in kinds else PERFORMANCE
            rule = FieldRule(path=section, kind=kind, reason=f"section {section} is set on one side only")
            c_value, r_value = _lookup(cand, section)[0], _lookup(ref, section)[0]
            path = section
        difference = Difference(path=path, kind=rule.kind, candidate=c_value, reference=r_value,
                                reason=rule.reason)
        (report.numerics if rule.kind == NUMERICS else report.performance).append(difference)
    return report
