"""Parallel layouts: the sizes of each parallel dimension and the checks that make a layout runnable.

The one home of the layout rules (world size, expert regrouping, heads and expert FFN split, stage splits, rows per
microbatch, pipeline microbatches, and what compiled blocks, image rows and the router's aux loss run with):
``layout_problems``, which train, the recipe, the card, the planner and the tuner all call. Pure Python, no ``torch.distributed``: the engine builds its device meshes from a validated layout,
the planner enumerates and scores layouts before anything runs.

Rank grouping follows Megatron-Core. Dense layers see ``world = tp * cp * dp * pp``. Expert layers
reuse the same GPUs of one pipeline stage (``tp * cp * dp`` of them), regrouped as
``etp * ep * edp``, where ``edp`` is the expert-data-parallel size over which expert optimizer state
is sharded. Hence ``ep * etp`` must divide ``tp * cp * dp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pydantic import ConfigDict, Field, StrictBool

from openrecipes.config.numbers import NumbersNotBooleans

__all__ = ["ParallelSizes", "LayoutConfig", "validate_layout", "stage_layer_counts", "expert_data_parallel_size",
           "microbatch_token_capacity", "rows_per_microbatch", "LayoutProblem", "LayoutError",
           "layout_problems", "heads_problem", "unsupported_reason", "with_world_size",
           "virtual_stage_layers", "rank_layers", "LayoutModel", "LayoutWorkload", "compile_problem",
           "pipeline_microbatch_problems"]


class ParallelSizes(NumbersNotBooleans):
    """The sizes of the parallel dimensions: shared by the recipe's layout and the recipe card's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(1, ge=1, description="tensor parallel size")
    pp: int = Field(1, ge=1, description="pipeline parallel size")
    cp: int = Field(1, ge=1, description="context parallel size")
    ep: int = Field(1, ge=1, description="expert parallel size")
    etp: int = Field(1, ge=1, description="expert tensor parallel size")
    dp: int = Field(1, ge=1, description="data parallel size")
    vpp: int = Field(1, ge=1, description="virtual pipeline stages per rank (interleaved 1F1B)")
    sequence_parallel: StrictBool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


class LayoutConfig(ParallelSizes):
    """One parallel layout, with the keys the recipe cards use."""

    pp_first_stage_layers: int | None = Field(None, ge=1)
    pp_last_stage_layers: int | None = Field(None, ge=1)
    max_tokens_per_gpu: int = Field(..., ge=1, description="tokens one GPU holds per microbatch")
    rows_per_microbatch: int | None = Field(None, ge=1)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size (valid only for a validated layout)."""
        return expert_data_parallel_size(self)

    def label(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.pp_first_stage_layers or self.pp_last_stage_layers:
            parts[-1] += f"({self.pp_first_stage_layers or '-'}/{self.pp_last_stage_layers or '-'})"
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        parts.append(f"EP{self.ep}")
        if self.etp > 1:
            parts.append(f"ETP{self.etp}")
        parts.append(f"DP{self.dp}")
        if self.sequence_parallel:
            parts.append("SP")
        return " ".join(parts)


def expert_data_parallel_size(layout: LayoutConfig) -> int:
    return (layout.tp * layout.cp * layout.dp) // (layout.ep * layout.etp)


def microbatch_token_capacity(layout: LayoutConfig) -> int:
    """Tokens of one microbatch: its rows are split over the cp ranks, each holding ``max_tokens_per_gpu``."""
    return layout.max_tokens_per_gpu * layout.cp


def rows_per_microbatch(layout: LayoutConfig, row_tokens: int) -> int:
    """Whole rows of ``row_tokens`` tokens in one microbatch: the layout's explicit value, else as many as its
    token capacity holds (at least one). Raises ValueError naming the field when the explicit value does not fit."""
    if row_tokens < 1:
        raise ValueError(f"row_tokens must be positive, got {row_tokens}")
    problem = _rows_fit_problem(layout, row_tokens)
    if problem:
        raise LayoutError(problem)
    return layout.rows_per_microbatch or max(1, microbatch_token_capacity(layout) // row_tokens)


def _rows_fit_problem(layout: LayoutConfig, row_tokens: int | None) -> LayoutProblem | None:
    """An explicit ``rows_per_microbatch`` whose rows (of ``row_tokens`` tokens; None: of one token at least) do not
    fit the microbatch's tokens."""
    rows, capacity = layout.rows_per_microbatch, microbatch_token_capacity(layout)
    if rows is None or rows * (row_tokens or 1) <= capacity:
        return None
    what = f"{rows} rows of {row_tokens} tokens exceed" if row_tokens else f"{rows} rows cannot fit in"
    return LayoutProblem("rows_per_microbatch", f"{what} max_tokens_per_gpu={layout.max_tokens_per_gpu} x "
                                                f"cp={layout.cp} tokens")


class LayoutError(ValueError):
    """A layout that cannot run; the message starts with the offending recipe key (``layout.tp: ...``)."""

    def __init__(self, problem: LayoutProblem) -> None:
        super().__init__(f"{problem.path}: {problem.message}")
        self.problem = problem


def stage_layer_counts(layout: LayoutConfig, num_layers: int) -> list[int]:
    """Decoder layers per pipeline stage: the first/last stage sizes asked for, the rest split evenly.

    Raises ValueError naming the field when the layers cannot be split that way.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    pp, first, last = layout.pp, layout.pp_first_stage_layers, layout.pp_last_stage_layers
    if pp == 1:
        for name, value in (("pp_first_stage_layers", first), ("pp_last_stage_layers", last)):
            if value is not None and value != num_layers:
                raise LayoutError(LayoutProblem(name, f"{name}={value} needs pp > 1 (pp=1 holds all {num_layers} "
                                                      "layers)"))
        return [num_layers]
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    field = "pp_first_stage_layers" if first is not None else "pp_last_stage_layers"
    if first is None and last is None:
        field = "pp"
        if pp > num_layers:  # every stage holds at least one layer
            raise LayoutError(LayoutProblem("pp", f"pp={pp} stages need at least {pp} layers; the model has "
                                                  f"{num_layers}"))
    if rest < 0:
        raise LayoutError(LayoutProblem(field, f"pp_first_stage_layers + pp_last_stage_layers = {num_layers - rest} "
                                               f"is more than the model's num_layers={num_layers}"))
    if middle == 0:
        if rest != 0:
            raise LayoutError(LayoutProblem(field, f"pp_first_stage_layers + pp_last_stage_layers = "
                                                   f"{num_layers - rest} must equal num_layers={num_layers} when pp=2"))
        return [first, last]  # type: ignore[list-item]
    if rest < middle or rest % middle:
        raise LayoutError(LayoutProblem(field, f"{rest} layers left for the {middle} other pipeline stage(s) do not "
                                               f"split evenly (num_layers={num_layers}, pp={pp}, first={first}, "
                                               f"last={last})"))
    per = rest // middle
    counts = [per] * middle
    if first is not None:
        counts.insert(0, first)
    if last is not None:
        counts.append(last)
    return counts


def virtual_stage_layers(layout: LayoutConfig, num_layers: int) -> list[range]:
    """The decoder layers of each virtual pipeline stage, in model order (``pp * vpp`` of them; ``pp`` without
    interleaving). Virtual stage ``v`` runs on pipeline rank ``v % pp`` (Megatron's and torch's interleaved order):
    rank ``r`` holds chunks ``r, r + pp, ...``, each ``1/vpp`` of its ``stage_layer_counts`` share, so an uneven first
    or last stage stays uneven in every round."""
    counts = stage_layer_counts(layout, num_layers)
    if any(c % layout.vpp for c in counts):
        raise LayoutError(LayoutProblem("vpp", f"every stage's layer count {counts} must be a multiple of "
                                               f"vpp={layout.vpp}"))
    ranges, start = [], 0
    for _ in range(layout.vpp):
        for count in counts:
            ranges.append(range(start, start + count // layout.vpp))
            start += count // layout.vpp
    return ranges


def rank_layers(layout: LayoutConfig, num_layers: int, pp_rank: int) -> list[tuple[int, range]]:
    """(virtual stage index, its layers) of every chunk pipeline rank ``pp_rank`` holds, in schedule order."""
    ranges = virtual_stage_layers(layout, num_layers)
    return [(v, ranges[v]) for v in range(pp_rank, len(ranges), layout.pp)]


class LayoutProblem(NamedTuple):
    """One reason a layout cannot run: the offending field and a message that names the numbers. ``field`` is a
    layout key (``tp``) or, for a rule about another section, its dotted recipe key (``kernels.compile``)."""

    field: str
    message: str

    @property
    def path(self) -> str:
        """The recipe key: ``layout.tp``, ``kernels.compile``."""
        return self.field if "." in self.field else f"layout.{self.field}"


@dataclass(frozen=True, kw_only=True)
class LayoutModel:
    """What the layout rules check of the model; a size left None is not checked (a card of an unknown model)."""

    num_layers: int | None = None
    num_experts: int | None = None
    heads: int | None = None  # attention (query) heads, split over tp
    kv_heads: int | None = None  # key/value heads, split over tp
    expert_ffn: int | None = None  # one expert's FFN width, split over etp
    # (layout field, why): the dimensions this engine's model of the family does not split (ModelFamily.not_split)
    not_split: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class LayoutWorkload:
    """What the layout rules check of the run; None, False or 0 is not checked."""

    global_batch: int | None = None  # rows per step
    row_tokens: int | None = None  # tokens of one row
    compile: bool = False  # kernels.compile
    image_rows: bool = False  # the rows hold images
    # with image rows: the decoder layers the first pipeline stage must hold (the towers run there and their
    # features are added after each of them)
    image_first_stage_layers: int = 0
    aux_loss_coef: float = 0.0  # moe.aux_loss_coef
    mtp: bool = False  # the recipe trains the multi-token-prediction layers (``mtp``)
    recompute_block_layers: int | None = None  # recompute.num_layers of method block: the first layers of a stage


def layout_problems(layout: LayoutConfig, *, world_size: int, model: LayoutModel | None = None,
                    workload: LayoutWorkload | None = None) -> list[LayoutProblem]:
    """Every reason ``layout`` cannot run ``model`` on ``world_size`` GPUs with ``workload``: the one layout check.

    Train refuses the first problem (``validate_layout``), the planner and the tuner never rank such a layout, a card
    lists them all. What ``model`` or ``workload`` leave unset is not checked.
    """
    model, workload = model or LayoutModel(), workload or LayoutWorkload()
    found = _size_problems(layout, world_size, model)
    found += _stage_problems(layout, model.num_layers)
    found += _recompute_problems(layout, model.num_layers, workload.recompute_block_layers)
    found += [p for p in (_rows_fit_problem(layout, workload.row_tokens),
                          compile_problem(layout, workload.compile)) if p]
    found += _image_problems(layout, model.num_layers, workload)
    found += _aux_loss_problems(layout, workload.aux_loss_coef)
    found += _mtp_problems(layout, workload.mtp)
    found += _batch_problems(layout, workload)
    return found


def _size_problems(layout: LayoutConfig, world_size: int, model: LayoutModel) -> list[LayoutProblem]:
    """The sizes against the world, the experts, the heads and the FFN they split."""
    found: list[LayoutProblem] = []
    product = layout.world_size
    if product != world_size:
        found.append(LayoutProblem("dp", f"tp·pp·cp·dp = {layout.tp}·{layout.pp}·{layout.cp}·{layout.dp} = {product} "
                                         f"must equal the world size {world_size}"))
    if model.num_experts is not None and model.num_experts % layout.ep:
        found.append(LayoutProblem("ep", f"ep={layout.ep} must divide num_experts={model.num_experts}"))
    dense_group = layout.tp * layout.cp * layout.dp
    if dense_group % (layout.ep * layout.etp):
        found.append(LayoutProblem("ep", f"ep·etp = {layout.ep}·{layout.etp} must divide tp·cp·dp = {dense_group} "
                                         "(expert layers regroup the GPUs of one pipeline stage as etp x ep x edp)"))
    problem = heads_problem(layout.tp, model)
    if problem:
        found.append(problem)
    if model.expert_ffn is not None and model.expert_ffn % layout.etp:
        found.append(LayoutProblem("etp", f"etp={layout.etp} must divide the expert FFN width {model.expert_ffn}"))
    if layout.sequence_parallel and layout.tp == 1:
        found.append(LayoutProblem("sequence_parallel", "needs tp > 1"))
    return found


def heads_problem(tp: int, model: LayoutModel) -> LayoutProblem | None:
    """tp splits the attention projections by head: it must divide the query and the key/value heads."""
    heads = [n for n in (model.heads, model.kv_heads) if n is not None]
    if not any(n % tp for n in heads):
        return None
    return LayoutProblem("tp", f"tp={tp} must divide the {model.heads} query and {model.kv_heads} key/value heads")


def _recompute_problems(layout: LayoutConfig, num_layers: int | None, block_layers: int | None) -> list[LayoutProblem]:
    """Block recompute names the first layers of each pipeline stage: no more than the largest stage holds."""
    if num_layers is None or block_layers is None:
        return []
    try:
        most = max(stage_layer_counts(layout, num_layers))
    except ValueError:  # the stages themselves are wrong: _stage_problems says so
        return []
    held = (f"the {most} decoder layers of the largest pipeline stage" if layout.pp > 1
            else f"the model's {most} decoder layers")
    return [] if block_layers <= most else [LayoutProblem(
        "recompute.num_layers", f"recompute.num_layers={block_layers} (method block) is more than {held}")]


def _stage_problems(layout: LayoutConfig, num_layers: int | None) -> list[LayoutProblem]:
    """The virtual stages and the layers split over the pipeline stages."""
    found: list[LayoutProblem] = []
    if layout.vpp > 1 and layout.pp == 1:
        found.append(LayoutProblem("vpp", f"vpp={layout.vpp} needs pp > 1"))
    if num_layers is not None:
        try:
            counts = stage_layer_counts(layout, num_layers)
        except LayoutError as error:
            found.append(error.problem)
        else:
            if layout.vpp > 1 and any(c % layout.vpp for c in counts):
                found.append(LayoutProblem("vpp", f"every stage's layer count {counts} must be a multiple of "
                                                  f"vpp={layout.vpp}"))
    return found


def compile_problem(sizes: ParallelSizes, compile: bool) -> LayoutProblem | None:
    """Compiled blocks (``kernels.compile``) run without tensor and context parallelism so far."""
    if not compile or (sizes.tp == 1 and sizes.cp == 1):
        return None
    return LayoutProblem("kernels.compile", f"not supported with tensor or context parallelism yet (layout.tp="
                                            f"{sizes.tp}, layout.cp={sizes.cp}: their hooks and collectives run inside "
                                            "the attention block); set it to false")


def _batch_problems(layout: LayoutConfig, workload: LayoutWorkload) -> list[LayoutProblem]:
    """The global batch split over the data-parallel ranks, then into the microbatches a pipeline needs."""
    if workload.global_batch is None:
        return []
    per_rank, rest = divmod(workload.global_batch, layout.dp)
    if rest or not per_rank:
        return [LayoutProblem("dp", f"dp={layout.dp} must divide global_batch={workload.global_batch} (each "
                                    "data-parallel rank takes an equal share of the rows)")]
    if layout.rows_per_microbatch is None and workload.row_tokens is None:
        return []  # the rows per microbatch are unknown
    rows = layout.rows_per_microbatch or max(1, microbatch_token_capacity(layout) // workload.row_tokens)
    return pipeline_microbatch_problems(layout, -(-per_rank // rows))


def pipeline_microbatch_problems(sizes: ParallelSizes, microbatches: int) -> list[LayoutProblem]:
    """What 1F1B needs of the ``microbatches`` one data-parallel rank runs per step: at least pp of them, and with
    interleaving (vpp > 1) whole rounds of about pp (torch's interleaved schedule)."""
    if sizes.pp == 1:
        return []
    if microbatches < sizes.pp:
        return [LayoutProblem("pp", f"pp={sizes.pp} needs at least {sizes.pp} microbatches per step on each "
                                    f"data-parallel rank, got {microbatches} (raise global_batch or lower "
                                    "layout.rows_per_microbatch or layout.max_tokens_per_gpu)")]
    rounds = max(1, microbatches // sizes.pp)
    if sizes.vpp > 1 and microbatches % rounds:
        return [LayoutProblem("vpp", f"interleaved 1F1B over pp={sizes.pp} runs the {microbatches} microbatches per "
                                     f"data-parallel rank in {rounds} equal rounds, which {microbatches} does not "
                                     "divide (choose global_batch so the microbatches are a multiple of pp)")]
    return []


def _image_problems(layout: LayoutConfig, num_layers: int | None, workload: LayoutWorkload) -> list[LayoutProblem]:
    """Image rows train with data, expert, context and pipeline parallelism, the towers on the first stage."""
    if not workload.image_rows:
        return []
    if layout.tp > 1:
        return [LayoutProblem("tp", f"image rows train with data, expert, context and pipeline parallelism only so "
                                    f"far (tensor parallelism beside the towers is not built yet); tp={layout.tp}: "
                                    "set layout.tp: 1")]
    if layout.pp == 1:
        return []
    if layout.cp > 1 or layout.vpp > 1:
        name = "cp" if layout.cp > 1 else "vpp"
        return [LayoutProblem(name, f"image rows run pipeline parallelism without context parallelism or "
                                    f"interleaving so far; {name}={getattr(layout, name)}: set it to 1")]
    needed = workload.image_first_stage_layers
    if num_layers is None or not needed:
        return []
    try:
        first = stage_layer_counts(layout, num_layers)[0]
    except LayoutError:
        return []  # the split itself is the problem, named by _stage_problems
    if first >= needed:
        return []
    return [LayoutProblem("pp_first_stage_layers", f"the first pipeline stage runs the vision towers and must hold the "
                                                   f"first {needed} decoder layers (image features are added after "
                                                   f"each); it holds {first}")]


def _aux_loss_problems(layout: LayoutConfig, coef: float) -> list[LayoutProblem]:
    """The router load-balancing loss pools every layer's routing over a microbatch's whole sequence before one
    product: stages holding other layers, or ranks holding other parts of the sequence, would each compute a
    different function."""
    if not coef:
        return []
    return [LayoutProblem("moe.aux_loss_coef", f"moe.aux_loss_coef={coef} is not supported with layout.{name}="
                                               f"{getattr(layout, name)}: the load-balancing loss is implemented for "
                                               "data and expert parallelism only")
            for name in ("pp", "tp", "cp") if getattr(layout, name) > 1][:1]


def _mtp_problems(layout: LayoutConfig, mtp: bool) -> list[LayoutProblem]:
    """The MTP layers read the main model's embedding, last hidden state and head, and the tokens one place further
    along the row: a pipeline stage holds only some of those, and a context or sequence shard lacks the next shard's
    first token."""
    if not mtp:
        return []
    return [LayoutProblem(name, f"mtp is not supported with layout.{name}={getattr(layout, name)}: multi-token "
                                 "prediction trains with data and expert parallelism only")
            for name in ("pp", "tp", "cp") if getattr(layout, name) > 1][:1]


def with_world_size(layout: LayoutConfig, world_size: int) -> LayoutConfig:
    """``layout`` with dp worked out from the world size when the recipe leaves it unset: world / (tp·pp·cp), as
    torchtitan's ``dp: -1``. A dp the recipe sets is kept, and so is the default when the other sizes do not divide
    the world size: ``layout_problems`` then names the mismatch."""
    rest = layout.tp * layout.pp * layout.cp
    if "dp" in layout.model_fields_set or world_size < 1 or world_size % rest:
        return layout
    return layout.model_copy(update={"dp": world_size // rest})


def validate_layout(layout: LayoutConfig, *, world_size: int, model: LayoutModel,
                    workload: LayoutWorkload | None = None) -> list[int]:
    """Check that ``layout`` can run ``model`` (its layer count given) on ``world_size`` GPUs with ``workload``.

    Returns the per-stage layer counts. Raises LayoutError (a ValueError) naming the recipe key of the first problem.
    """
    if model.num_layers is None:
        raise ValueError("validate_layout needs the model's num_layers")
    problems = layout_problems(layout, world_size=world_size, model=model, workload=workload)
    if problems:
        raise LayoutError(problems[0])
    return stage_layer_counts(layout, model.num_layers)


def unsupported_reason(layout: LayoutConfig, model: LayoutModel | None = None) -> str | None:
    """Why this engine cannot run ``layout`` (a message naming the keys), or None when it can: its own rules, and
    with ``model`` the dimensions that model's family does not split. The planner uses it to rank only runnable
    layouts for ``--engine openrecipes`` (another engine may run what this one does not)."""
    if layout.tp > 1 and not layout.sequence_parallel:
        return "layout.sequence_parallel: tensor parallelism runs with sequence parallelism; set it to true"
    for field, why in model.not_split if model is not None else ():
        if getattr(layout, field) > 1:
            return f"layout.{field}: {why}"
    return None
