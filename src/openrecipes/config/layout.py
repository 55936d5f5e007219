"""Parallel layouts: the sizes of each parallel dimension and the checks that make a layout runnable.

The one home of the layout rules (world size, expert regrouping, stage splits, rows per microbatch); the
recipe, the card, the planner and the loop all call these functions. Pure Python, no ``torch.distributed``: the engine builds its device meshes from a validated layout,
the planner enumerates and scores layouts before anything runs.

Rank grouping follows Megatron-Core. Dense layers see ``world = tp * cp * dp * pp``. Expert layers
reuse the same GPUs of one pipeline stage (``tp * cp * dp`` of them), regrouped as
``etp * ep * edp``, where ``edp`` is the expert-data-parallel size over which expert optimizer state
is sharded. Hence ``ep * etp`` must divide ``tp * cp * dp``.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ParallelSizes", "LayoutConfig", "validate_layout", "stage_layer_counts", "expert_data_parallel_size",
           "microbatch_token_capacity", "rows_per_microbatch", "LayoutProblem", "LayoutError",
           "layout_problems", "enumerate_layouts", "divisors", "unsupported_reason", "with_world_size",
           "virtual_stage_layers", "rank_layers"]


class ParallelSizes(BaseModel):
    """The sizes of the parallel dimensions: shared by the recipe's layout and the recipe card's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(1, ge=1, description="tensor parallel size")
    pp: int = Field(1, ge=1, description="pipeline parallel size")
    cp: int = Field(1, ge=1, description="context parallel size")
    ep: int = Field(1, ge=1, description="expert parallel size")
    etp: int = Field(1, ge=1, description="expert tensor parallel size")
    dp: int = Field(1, ge=1, description="data parallel size")
    vpp: int = Field(1, ge=1, description="virtual pipeline stages per rank (interleaved 1F1B)")
    sequence_parallel: bool = False

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
    capacity = microbatch_token_capacity(layout)
    rows = layout.rows_per_microbatch or max(1, capacity // row_tokens)
    if layout.rows_per_microbatch is not None and rows * row_tokens > capacity:
        raise ValueError(f"layout.rows_per_microbatch: {rows} rows of {row_tokens} tokens exceed "
                         f"layout.max_tokens_per_gpu={layout.max_tokens_per_gpu} x cp={layout.cp}")
    return rows


class LayoutError(ValueError):
    """A layout that cannot run; the message starts with the offending field."""

    def __init__(self, problem: LayoutProblem) -> None:
        super().__init__(f"{problem.field}: {problem.message}")
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
    """One reason a layout cannot run: the offending field and a message that names the numbers."""

    field: str
    message: str


def layout_problems(layout: LayoutConfig, *, world_size: int, num_layers: int | None = None,
                    num_experts: int | None = None) -> list[LayoutProblem]:
    """Every reason ``layout`` cannot run ``num_layers`` layers of ``num_experts`` experts on ``world_size`` GPUs.

    The one layout check: the loop and the planner raise the first problem (``validate_layout``), a card lists them
    all. A count left as None is not checked (a card of a model whose shape is unknown).
    """
    found: list[LayoutProblem] = []
    product = layout.world_size
    if product != world_size:
        found.append(LayoutProblem("dp", f"tp·pp·cp·dp = {layout.tp}·{layout.pp}·{layout.cp}·{layout.dp} = {product} "
                                         f"must equal the world size {world_size}"))
    if num_experts is not None and num_experts % layout.ep:
        found.append(LayoutProblem("ep", f"ep={layout.ep} must divide num_experts={num_experts}"))
    dense_group = layout.tp * layout.cp * layout.dp
    if dense_group % (layout.ep * layout.etp):
        found.append(LayoutProblem("ep", f"ep·etp = {layout.ep}·{layout.etp} must divide tp·cp·dp = {dense_group} "
                                         "(expert layers regroup the GPUs of one pipeline stage as etp x ep x edp)"))
    if layout.sequence_parallel and layout.tp == 1:
        found.append(LayoutProblem("sequence_parallel", "needs tp > 1"))
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
    if layout.rows_per_microbatch is not None and layout.rows_per_microbatch > microbatch_token_capacity(layout):
        found.append(LayoutProblem("rows_per_microbatch", f"{layout.rows_per_microbatch} rows cannot fit in "
                                   f"max_tokens_per_gpu={layout.max_tokens_per_gpu} x cp={layout.cp} tokens"))
    return found


def with_world_size(layout: LayoutConfig, world_size: int) -> LayoutConfig:
    """``layout`` with dp worked out from the world size when the recipe leaves it unset: world / (tp·pp·cp), as
    torchtitan's ``dp: -1``. A dp the recipe sets is kept, and so is the default when the other sizes do not divide
    the world size: ``layout_problems`` then names the mismatch."""
    rest = layout.tp * layout.pp * layout.cp
    if "dp" in layout.model_fields_set or world_size < 1 or world_size % rest:
        return layout
    return layout.model_copy(update={"dp": world_size // rest})


def validate_layout(layout: LayoutConfig, *, world_size: int, num_layers: int, num_experts: int) -> list[int]:
    """Check that ``layout`` can run ``num_layers`` layers and ``num_experts`` experts on ``world_size`` GPUs.

    Returns the per-stage layer counts. Raises ValueError whose message starts with the offending field.
    """
    problems = layout_problems(layout, world_size=world_size, num_layers=num_layers, num_experts=num_experts)
    if problems:
        raise LayoutError(problems[0])
    return stage_layer_counts(layout, num_layers)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _stage_splits(num_layers: int, pp: int) -> Iterator[tuple[int | None, int | None]]:
    """(first, last) stage sizes worth trying: an even split, and symmetric lighter/heavier end stages."""
    if pp == 1:
        yield None, None
        return
    if num_layers % pp == 0:
        yield None, None
    if pp == 2:
        return
    for end in range(1, num_layers // 2 + 1):
        rest = num_layers - 2 * end
        if rest >= pp - 2 and rest % (pp - 2) == 0 and end != rest // (pp - 2):
            yield end, end


def enumerate_layouts(world_size: int, *, num_layers: int, num_experts: int, max_tokens_per_gpu: int,
                      num_query_groups: int | None = None, max_tp: int = 8,
                      cp_options: Iterable[int] = (1, 2, 4, 8), etp_options: Iterable[int] = (1,),
                      vpp: int = 1) -> list[LayoutConfig]:
    """Every valid layout for ``world_size`` GPUs (sequence parallel on whenever tp > 1).

    ``num_query_groups`` (KV heads) limits tp to its divisors; ``max_tp`` keeps TP inside a node.
    Only layouts that pass ``validate_layout`` are returned.
    """
    found: list[LayoutConfig] = []
    cps, etps = sorted(set(cp_options)), sorted(set(etp_options))
    for tp in divisors(world_size):
        if tp > max_tp or (num_query_groups is not None and num_query_groups % tp):
            continue
        for pp in divisors(world_size // tp):
            if pp > num_layers:
                continue
            for cp in cps:
                if (world_size // (tp * pp)) % cp:
                    continue
                dp = world_size // (tp * pp * cp)
                for etp in etps:
                    for ep in divisors(num_experts):
                        for first, last in _stage_splits(num_layers, pp):
                            layout = LayoutConfig(
                                tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, vpp=vpp,
                                sequence_parallel=tp > 1, pp_first_stage_layers=first,
                                pp_last_stage_layers=last, max_tokens_per_gpu=max_tokens_per_gpu)
                            try:
                                validate_layout(layout, world_size=world_size, num_layers=num_layers,
                                                num_experts=num_experts)
                            except ValueError:
                                continue
                            found.append(layout)
    return found


def unsupported_reason(layout: LayoutConfig) -> str | None:
    """Why this engine cannot run ``layout`` (a message naming the keys), or None when it can. The planner uses it
    to rank only runnable layouts for ``--engine openrecipes``."""
    if layout.tp > 1 and not layout.sequence_parallel:
        return "layout.sequence_parallel: tensor parallelism runs with sequence parallelism; set it to true"
    return None
