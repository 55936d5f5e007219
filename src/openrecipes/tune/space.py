"""The search space: what the tuner may change, derived from the numerics rules.

A candidate is the starting recipe with some *knobs* turned. Each knob sets performance-only fields
(``openrecipes.verify.rules``): the parallel layout, rows per microbatch (at the same global batch), recompute,
optimizer offload (its fraction, overlap and where the update runs), activation offload, the attention and expert
kernels, compiled blocks, the chunked loss and the CUDA allocator. ``candidate_recipe`` builds the recipe and
refuses it unless ``compare_recipes`` against the start finds no numerics-affecting difference, so a candidate that
changes what the run computes can never reach a trial.
"""

from __future__ import annotations

import hashlib
import json
import typing
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from openrecipes.config.layout import (LayoutConfig, LayoutModel, LayoutWorkload, ParallelSizes, compile_problem,
                                      layout_problems, pipeline_microbatch_problems)
from openrecipes.config.layout_space import divisors, enumerate_layouts
from openrecipes.config.layout import rows_per_microbatch
from openrecipes.config.kernel_names import backend_runs
from openrecipes.config.recipe import Kernels, Offload, Recipe, recipe_from_dict
from openrecipes.config.numerics import PERFORMANCE, classify
from openrecipes.verify.rules import compare_recipes

LAYOUT_FIELDS = ("tp", "pp", "cp", "ep", "etp", "dp", "sequence_parallel", "pp_first_stage_layers",
                 "pp_last_stage_layers")
OFFLOAD_FRACTIONS = (0.0, 1.0)  # the endpoints; the fraction between them is solved (tune/solve.py)
FRACTION_STEP = 0.05  # the engine offloads whole parameter shards up to any fraction; a twentieth is fine enough
# the kernels a search tries: not the exact oracles (dense masked attention, the per-expert loop), which are for
# checking, never faster (on one H200 the loop ran the 16-layer trial at 4,546 tokens/s against 25,738)
ORACLE_KERNELS = ("reference", "loop")
ATTENTION_KERNELS = tuple(k for k in typing.get_args(Kernels.model_fields["attention"].annotation)
                          if k not in ORACLE_KERNELS)
EXPERT_KERNELS = tuple(k for k in typing.get_args(Kernels.model_fields["experts"].annotation)
                       if k not in ORACLE_KERNELS)
# tokens per chunk of the LM head + loss (0: the whole microbatch's logits at once); a few thousand tokens keep the
# chunk's logits small against a ~150k vocabulary while each head matmul stays large
LOSS_CHUNKS = (0, 2048, 8192)


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the space needs to know of the model and the workload."""

    num_layers: int
    num_experts: int
    kv_heads: int
    row_tokens: int
    world_size: int
    cuda: bool = True  # the trials run on GPUs (False: CPU processes, where CUDA-only kernels are never offered)
    heads: int | None = None  # attention heads (None: not checked)
    expert_ffn: int | None = None  # one expert's FFN width (None: not checked)
    image_rows: bool = False  # the rows hold images
    image_first_stage_layers: int = 0  # with image rows: the decoder layers the first pipeline stage must hold
    attention_sinks: bool = False  # per-head sink logits (gpt-oss), which flash varlen attention has no term for

    def layout_model(self) -> LayoutModel:
        return LayoutModel(num_layers=self.num_layers, num_experts=self.num_experts, heads=self.heads,
                           kv_heads=self.kv_heads, expert_ffn=self.expert_ffn)

    def layout_workload(self, start: Recipe) -> LayoutWorkload:
        """What the layout rules check of a candidate's run, but its global batch split (``rows_options`` checks it
        for each rows choice) and compiled blocks (``compile_options``)."""
        return LayoutWorkload(row_tokens=self.row_tokens, image_rows=self.image_rows,
                              image_first_stage_layers=self.image_first_stage_layers,
                              aux_loss_coef=start.moe.aux_loss_coef, mtp=start.mtp is not None)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The knobs of one candidate (a point of the space). ``layout`` holds the LAYOUT_FIELDS."""

    layout: tuple[tuple[str, Any], ...]
    rows: int  # rows per microbatch
    recompute: tuple[str, str, int]  # granularity, method, num_layers
    offload: float
    overlap: bool
    attention: str
    experts: str
    compile: bool = False
    offload_update: str = "device"
    offload_activations: bool = False
    loss_chunk: int = 0  # kernels.loss_chunk_tokens
    allocator: str = "expandable"  # kernels.allocator

    def layout_dict(self) -> dict[str, Any]:
        return dict(self.layout)


OFFLOAD_UPDATES = typing.get_args(Offload.model_fields["update"].annotation)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    settings: Settings
    recipe: Recipe
    changes: dict[str, Any] = field(hash=False)  # dotted performance-only path -> value, against the start

    @property
    def key(self) -> str:
        return changes_key(self.changes)


def changes_key(changes: dict[str, Any]) -> str:
    """A stable name for a set of changes: the same recipe always gets the same key ("start" for none)."""
    if not changes:
        return "start"
    text = json.dumps(changes, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def describe_changes(changes: dict[str, Any]) -> str:
    if not changes:
        return "the starting point"
    return ", ".join(f"{path}={json.dumps(value)}" for path, value in sorted(changes.items()))


def start_settings(start: Recipe, facts: ModelFacts) -> Settings:
    lay, rec = start.layout, start.recompute
    simple = {knob.name: _read(start, knob.path) for knob in KNOB_TABLE if knob.path}
    return Settings(layout=tuple((name, getattr(lay, name)) for name in LAYOUT_FIELDS),
                    rows=rows_per_microbatch(lay, facts.row_tokens),
                    recompute=(rec.granularity, rec.method, rec.num_layers), **simple)


def _read(recipe: Recipe, path: str) -> Any:
    value: Any = recipe
    for part in path.split("."):
        value = getattr(value, part)
    return value


def check_performance_only(changes: dict[str, Any]) -> None:
    """Refuse any change of a numerics field; the error names it and the rule's reason."""
    for path in changes:
        rule = classify(path)
        if rule.kind != PERFORMANCE:
            raise ValueError(f"tune: {path} is a numerics field ({rule.reason}); the tuner changes only "
                             "performance-only fields")


def candidate_recipe(start: Recipe, settings: Settings, facts: ModelFacts) -> Candidate:
    """The start with ``settings`` applied. Raises ValueError naming the field when the recipe is invalid, and
    when it would differ from the start in a numerics field (never expected: every field set here is
    performance-only, and this is the guard that keeps it so)."""
    tree = start.model_dump(mode="json")
    layout = tree["layout"]
    layout.update(settings.layout_dict())
    base = start_settings(start, facts)
    same_rows = settings.rows == base.rows and layout["cp"] == start.layout.cp
    if not same_rows:  # the microbatch holds `rows` whole rows, split over cp ranks
        layout["rows_per_microbatch"] = settings.rows
        layout["max_tokens_per_gpu"] = -(-settings.rows * facts.row_tokens // layout["cp"])
    granularity, method, num_layers = settings.recompute
    tree["recompute"].update(granularity=granularity, method=method, num_layers=num_layers)
    for knob in KNOB_TABLE:
        if knob.path:
            section, name = knob.path.split(".")
            tree[section][name] = getattr(settings, knob.name)
    recipe = recipe_from_dict(tree, source="tune candidate")
    report = compare_recipes(recipe, start, candidate_name="candidate", reference_name="start")
    if not report.passed:  # the one guarantee of the tuner: numerics never change
        raise ValueError("tune: a candidate changes numerics fields: "
                         + ", ".join(d.path for d in report.numerics))
    changes = {d.path: d.candidate for d in report.performance}
    check_performance_only(changes)
    return Candidate(settings=settings, recipe=recipe, changes=changes)


def _uneven_splits(layout: LayoutConfig, facts: ModelFacts, workload: LayoutWorkload) -> Iterator[LayoutConfig]:
    """Lighter or heavier first/last pipeline stages around the even share (the embedding sits on the first
    stage, the LM head and loss on the last)."""
    if layout.pp < 2 or layout.pp_first_stage_layers or layout.pp_last_stage_layers:
        return
    share = max(1, facts.num_layers // layout.pp)
    sizes = [s for s in range(share - 2, share + 2) if 1 <= s < facts.num_layers]
    for first in sizes:
        for last in sizes:
            if first == last == share and facts.num_layers % layout.pp == 0:
                continue  # the even split, already there
            split = layout.model_copy(update={"pp_first_stage_layers": first, "pp_last_stage_layers": last})
            if not layout_problems(split, world_size=facts.world_size, model=facts.layout_model(), workload=workload):
                yield split


def layout_options(start: Recipe, facts: ModelFacts) -> list[tuple[tuple[str, Any], ...]]:
    """Every valid layout at the start's world size: dp, ep, etp, tp with sequence parallelism, cp, pp with even
    and uneven first/last stages. Rules from config.layout (the ones train applies)."""
    workload = facts.layout_workload(start)
    found = enumerate_layouts(facts.world_size, model=facts.layout_model(), workload=workload,
                              max_tokens_per_gpu=start.layout.max_tokens_per_gpu, vpp=start.layout.vpp,
                              cp_options=divisors(facts.world_size), etp_options=divisors(facts.world_size))
    found += [split for layout in found for split in _uneven_splits(layout, facts, workload)]
    options = [tuple((name, getattr(layout, name)) for name in LAYOUT_FIELDS) for layout in found]
    own = tuple((name, getattr(start.layout, name)) for name in LAYOUT_FIELDS)
    return list(dict.fromkeys([own, *options]))


def rows_options(start: Recipe, layout: dict[str, Any]) -> list[int]:
    """Rows per microbatch that split each data-parallel rank's rows of the global batch evenly, into as many
    microbatches as the pipeline needs (the layout rules')."""
    per_rank, rest = divmod(start.global_batch, layout["dp"])
    if not per_rank or rest:
        return []
    sizes = ParallelSizes(pp=layout["pp"], vpp=start.layout.vpp)
    return [rows for rows in divisors(per_rank) if not pipeline_microbatch_problems(sizes, per_rank // rows)]


def recompute_options(facts: ModelFacts) -> list[tuple[str, str, int]]:
    """Every granularity on every layer; the whole layer or the experts on the first few layers or half of them."""
    options = [(granularity, "uniform", 1) for granularity in ("none", "selective", "attention_core", "experts",
                                                                 "full_keep_attention", "full")]
    blocks = sorted(n for n in {1, 2, max(1, facts.num_layers // 2)} if n <= facts.num_layers)
    options += [("full", "block", n) for n in blocks]
    options += [("experts", "block", n) for n in blocks if n >= 2]
    return options


def offload_options(start: Recipe, around: float | None = None) -> list[float]:
    """The endpoints, and next to ``around`` one FRACTION_STEP either way (a measured peak refines a solved
    fraction); the fraction that fits is solved, not listed (tune/solve.py)."""
    if start.precision != "bf16":
        return [0.0]
    near = [] if around is None else [round(around + d, 6) for d in (-FRACTION_STEP, FRACTION_STEP)]
    return sorted({*OFFLOAD_FRACTIONS, *(f for f in near if 0.0 <= f <= 1.0)})


def compile_options(layout: dict[str, Any]) -> list[bool]:
    sizes = ParallelSizes(tp=layout["tp"], cp=layout["cp"])  # the layout rule the recipe applies
    return [compiled for compiled in (False, True) if not compile_problem(sizes, compiled)]


def first_ranking_space(start: Recipe, facts: ModelFacts, *, with_compile: bool = False) -> Iterator[Settings]:
    """The settings the planner ranks first: the product of the values of every knob the table ranks first (layout
    x rows per microbatch x recompute x offload endpoints, what the planner models, and compiled blocks where the
    target has a measured prior, ``with_compile``), each given the knobs before it; the solved offload fraction and
    recomputed layers are added by the search; the other knobs stay as in the start and are explored around the
    best measured."""
    ranked = [knob for knob in KNOB_TABLE if knob.first is not None]

    def expand(settings: Settings, depth: int) -> Iterator[Settings]:
        if depth == len(ranked):
            yield settings
            return
        knob = ranked[depth]
        for value in knob.first(start, facts, settings, with_compile):
            yield from expand(replace(settings, **{knob.name: value}), depth + 1)

    yield from expand(start_settings(start, facts), 0)


def knob_values(knob: str, start: Recipe, facts: ModelFacts, around: Settings) -> list[Any]:
    """The values one knob may take next to ``around``."""
    return KNOB_BY_NAME[knob].values(start, facts, around)


def neighbours(around: Settings, start: Recipe, facts: ModelFacts) -> list[tuple[str, Settings]]:
    """Every setting one knob away from ``around`` (a new layout keeps the rows per microbatch when they still
    divide the rank's rows, else the nearest that does)."""
    found = []
    for knob in KNOBS:
        for value in knob_values(knob, start, facts, around):
            if value == getattr(around, knob):
                continue
            moved = replace(around, **{knob: value})
            if knob == "layout":
                rows = rows_options(start, dict(value))
                if not rows:
                    continue
                if moved.rows not in rows:
                    moved = replace(moved, rows=min(rows, key=lambda r: abs(r - around.rows)))
                if moved.compile not in compile_options(dict(value)):
                    moved = replace(moved, compile=False)
            found.append((knob, moved))
    return found


# ---- the knobs ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Knob:
    """One thing the tuner may turn: its ``Settings`` field; the one recipe field it sets (``path``; None for the
    layout, rows and recompute, which ``candidate_recipe`` writes across several fields); its values next to a
    setting; and, when the planner ranks it first, its values given the knobs before it in the table and whether
    compiled blocks are ranked (``first``), and whether it trades speed for device memory (``frees_memory``). A knob
    without ``first`` stays as in the start until the search explores around the best measured. A new knob is a
    ``Settings`` field and one row here."""

    name: str
    path: str | None
    values: Callable[[Recipe, ModelFacts, Settings], list[Any]]
    first: Callable[[Recipe, ModelFacts, Settings, bool], list[Any]] | None = None
    # trades speed for device memory: what a start that does not fit may change to fit (tune/reference.py)
    frees_memory: bool = False


def _recompute_values(start: Recipe, facts: ModelFacts, around: Settings) -> list[Any]:
    granularity, method, layers = around.recompute
    near = [(granularity, method, n) for n in (layers - 1, layers + 1) if method == "block" and 1 <= n < facts.num_layers]
    return list(dict.fromkeys(recompute_options(facts) + near))


def _kernel_values(kind: str) -> Callable[[Recipe, ModelFacts, Settings], list[Any]]:
    kernels = ATTENTION_KERNELS if kind == "attention" else EXPERT_KERNELS
    def runs(backend: str, facts: ModelFacts, start: Recipe) -> bool:
        sinks_refused = kind == "attention" and backend == "varlen" and facts.attention_sinks  # attention.py refuses
        return backend_runs(kind, backend, cuda=facts.cuda, bf16=start.precision == "bf16") and not sinks_refused

    return lambda start, facts, around: [k for k in kernels if runs(k, facts, start)]


def _allocator_values(start: Recipe, facts: ModelFacts, around: Settings) -> list[Any]:
    # expandable segments on GPUs: never more memory reserved than the caching allocator's, and the same speed where
    # both fit (one H200, two workloads: BENCHMARKS.md, call d), so a caching start is moved, never the other way;
    # on CPU the setting does nothing and stays the start's
    return ["expandable"] if facts.cuda else [start.kernels.allocator]


def _first_compile(start: Recipe, facts: ModelFacts, around: Settings, with_compile: bool) -> list[Any]:
    allowed = compile_options(around.layout_dict())
    return allowed if with_compile else [around.compile and around.compile in allowed]


KNOB_TABLE: tuple[Knob, ...] = (
    Knob("layout", None, lambda start, facts, around: layout_options(start, facts),
         first=lambda start, facts, around, compiled: layout_options(start, facts), frees_memory=True),
    Knob("rows", None, lambda start, facts, around: rows_options(start, around.layout_dict()),
         first=lambda start, facts, around, compiled: rows_options(start, around.layout_dict()), frees_memory=True),
    Knob("recompute", None, _recompute_values,
         first=lambda start, facts, around, compiled: recompute_options(facts), frees_memory=True),
    Knob("offload", "offload.fraction", lambda start, facts, around: offload_options(start, around.offload),
         first=lambda start, facts, around, compiled: offload_options(start), frees_memory=True),
    Knob("overlap", "offload.overlap", lambda start, facts, around: [True, False] if around.offload else []),
    Knob("offload_update", "offload.update",
         lambda start, facts, around: list(OFFLOAD_UPDATES) if around.offload else []),
    Knob("attention", "kernels.attention", _kernel_values("attention")),
    Knob("experts", "kernels.experts", _kernel_values("experts")),
    Knob("compile", "kernels.compile", lambda start, facts, around: compile_options(around.layout_dict()),
         first=_first_compile),
    Knob("offload_activations", "offload.activations", lambda start, facts, around: [False, True], frees_memory=True),
    Knob("loss_chunk", "kernels.loss_chunk_tokens", lambda start, facts, around: list(LOSS_CHUNKS), frees_memory=True),
    Knob("allocator", "kernels.allocator", _allocator_values,
         first=lambda start, facts, around, compiled: _allocator_values(start, facts, around), frees_memory=True),
)
KNOB_BY_NAME = {knob.name: knob for knob in KNOB_TABLE}
KNOBS = tuple(KNOB_BY_NAME)
MEMORY_KNOBS = tuple(knob.name for knob in KNOB_TABLE if knob.frees_memory)


def changed_knobs(settings: Settings, base: Settings) -> tuple[str, ...]:
    """The knobs ``settings`` turns away from ``base`` (a new layout is one knob, whatever fields it moves)."""
    return tuple(knob for knob in KNOBS if getattr(settings, knob) != getattr(base, knob))
