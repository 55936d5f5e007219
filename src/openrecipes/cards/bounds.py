"""Bounds on a card's figures: every number must be one the hardware, the model and the run could have produced.

The consistency checks (``checks.py``, ``verification_checks.py``) hold the numbers to each other; these hold them
to the world: the throughput under the hardware table's peak (``measure.metrics.mfu`` at most 1), losses finite and
not negative, dates between the first card and today, GPU-hours that the steps' time allows, memory within the GPU's,
active parameters as the model registry counts them, and hub sources pinned on what is verified.
"""

from __future__ import annotations

import datetime
import math
import statistics

from openrecipes.cards import reference
from openrecipes.cards.findings import Finding, Loc, half_unit
from openrecipes.cards.paths import is_hub_source
from openrecipes.cards.schema import CurvePoint, RecipeCard
from openrecipes.measure.metrics import mfu

# a stated peak above this many times the hardware table's for the same GPU type is a typing error, not a faster part
MAX_PEAK_OVERRIDE_FACTOR = 2.0
# a window whose step times vary more than this is not a steady-state measurement
MAX_STEP_TIME_CV_PERCENT = 100.0
# dates: not after today (a day of clock skew between the machine that wrote them and this one), not before the
# catalog's evidence began (its earliest, a component test of a published card, is of 2026-10-14)
CLOCK_SKEW = datetime.timedelta(days=1)
FIRST_CARD_DATE = datetime.date(2026, 10, 1)
# GPU-hours against GPUs x the run's steps at the window's step time: a run's steps outside the window are slower
# (warm-up) rather than faster, and startup adds at most this many hours on each GPU of each run
MIN_GPU_HOURS_SHARE = 0.5
MAX_GPU_HOURS_FACTOR = 10.0
STARTUP_HOURS_PER_GPU = 1.0
# relative slack of cross-checks between figures written rounded apart from each other
RELATIVE_TOLERANCE = 0.01


def date_findings(value: datetime.date, loc: Loc, today: datetime.date | None = None) -> list[Finding]:
    today = today or datetime.date.today()
    if value > today + CLOCK_SKEW:
        return [Finding(loc=loc, message=f"{value} is in the future (today is {today})")]
    if value < FIRST_CARD_DATE:
        return [Finding(loc=loc, message=f"{value} is before the first card of the catalog ({FIRST_CARD_DATE})")]
    return []


def loss_findings(points: list[CurvePoint], loc: Loc) -> list[Finding]:
    """A cross-entropy loss is never negative (NaN and infinity the schema already refuses)."""
    for index, point in enumerate(points):
        if point.loss < 0:
            return [Finding(loc=(*loc, index, "loss"), message=f"{point.loss} at step {point.step}: a loss is >= 0")]
    return []


def throughput_finding(active_params: int, tokens_per_s: float, peak: float, loc: Loc, where: str) -> list[Finding]:
    """6 x N x tokens/s above ``peak``: the throughput, N or the hardware is wrong."""
    implied = mfu(active_params, tokens_per_s, peak)
    if implied <= 1:
        return []
    return [Finding(loc=loc, message=(
        f"{tokens_per_s} tokens/s/GPU implies an MFU of {implied:.1%} (6 x N {active_params} / peak {peak:.4g} of "
        f"{where}): above 100 %"))]


def card_peak_bound(card: RecipeCard) -> float | None:
    """The peak a card's throughput is held under: the table's (the CPU bound for cpu), or the stated one no more
    than MAX_PEAK_OVERRIDE_FACTOR above it."""
    table = reference.peak_bound(card.gpu.type)
    stated = card.gpu.peak_bf16_dense_flops
    if stated is None:
        return table
    return stated if table is None else min(stated, table * (1 if reference.is_cpu(card.gpu.type)
                                                             else MAX_PEAK_OVERRIDE_FACTOR))


def check_card_bounds(card: RecipeCard, today: datetime.date | None = None) -> list[Finding]:
    out: list[Finding] = []
    for check in (_peak_override, _gpu_memory, _step_time_cv, _gpu_hours, _active_params, _curves, _headline,
                  _steps):
        out.extend(check(card))
    out.extend(date_findings(card.result.measured, ("result", "measured"), today))
    for index, test in enumerate(card.correctness.component_tests):
        out.extend(date_findings(test.date, ("correctness", "component_tests", index, "date"), today))
    if card.status == "verified":
        out.extend(_hub_revisions(card))
    return out


def _peak_override(card: RecipeCard) -> list[Finding]:
    stated, table = card.gpu.peak_bf16_dense_flops, reference.peak_bound(card.gpu.type)
    if stated is None or table is None:
        return []
    cpu = reference.is_cpu(card.gpu.type)
    limit = table * (1 if cpu else MAX_PEAK_OVERRIDE_FACTOR)
    if stated <= limit:
        return []
    what = (f"the hardware table's bound {table:.4g} for a CPU process" if cpu else
            f"{MAX_PEAK_OVERRIDE_FACTOR:g} x the hardware table's {table:.4g} for {card.gpu.type}")
    return [Finding(loc=("gpu", "peak_bf16_dense_flops"), message=f"{stated:.4g} FLOP/s is above {what}")]


def _capacity_gib(card: RecipeCard) -> float:
    # the stated GB read generously as GiB, and no more than the table's reported memory where it knows the GPU
    table = None if reference.is_cpu(card.gpu.type) else reference.memory_gib(card.gpu.type)
    return min(card.gpu.memory_gb, table) if table is not None else card.gpu.memory_gb


def _gpu_memory(card: RecipeCard) -> list[Finding]:
    # less than the part is sold with may be a cap the run set; more is another part
    sold = None if reference.is_cpu(card.gpu.type) else reference.memory_gb(card.gpu.type)
    if sold is not None and card.gpu.memory_gb > sold * (1 + RELATIVE_TOLERANCE):
        return [Finding(loc=("gpu", "memory_gb"), message=(
            f"{card.gpu.memory_gb} is more than the {sold:g} GB the hardware table sells {card.gpu.type} with"))]
    return []


def _step_time_cv(card: RecipeCard) -> list[Finding]:
    cv = card.result.step_time_cv_percent
    if cv > MAX_STEP_TIME_CV_PERCENT:
        return [Finding(loc=("result", "step_time_cv_percent"), message=(
            f"{cv} is above {MAX_STEP_TIME_CV_PERCENT:g} %: the window's step times are not a steady measurement"))]
    return []


def _gpu_hours(card: RecipeCard) -> list[Finding]:
    res, loc = card.result, ("result", "gpu_hours")
    if res.gpu_hours <= 0:
        return [Finding(loc=loc, message=f"{res.gpu_hours}: a measured run took GPU time, so GPU-hours are > 0")]
    step_s = card.workload.global_batch * card.workload.row_tokens / (res.tokens_per_s_per_gpu * card.gpu.count)
    steps_gpu_hours = res.steps_per_run * step_s * card.gpu.count / 3600
    low = MIN_GPU_HOURS_SHARE * steps_gpu_hours
    high = res.runs * (MAX_GPU_HOURS_FACTOR * steps_gpu_hours + STARTUP_HOURS_PER_GPU * card.gpu.count)
    if res.gpu_hours + half_unit(res.gpu_hours) < low or res.gpu_hours > high:
        return [Finding(loc=loc, message=(
            f"{res.gpu_hours} is outside {low:.4g}..{high:.4g}: {card.gpu.count} GPUs x {res.steps_per_run} steps x "
            f"{step_s:.4g} s a step (global_batch x row_tokens / tokens/s / GPUs) is {steps_gpu_hours:.4g} GPU-hours, "
            f"of which at least {MIN_GPU_HOURS_SHARE:g}; at most {MAX_GPU_HOURS_FACTOR:g} x that and "
            f"{STARTUP_HOURS_PER_GPU:g} hour of startup per GPU, for each of {res.runs} run(s)"))]
    return []


def _active_params(card: RecipeCard) -> list[Finding]:
    count = card.result.active_params.count
    expected = reference.model_active_params(card.model)
    if expected is not None and abs(count - expected) > RELATIVE_TOLERANCE * expected:
        return [Finding(loc=("result", "active_params", "count"), message=(
            f"{count} but the model registry counts N = {expected} active parameters for {card.model}"))]
    return []


def _curves(card: RecipeCard) -> list[Finding]:
    if card.curves is None:
        return []
    out: list[Finding] = []
    capacity = _capacity_gib(card)
    wl = card.workload
    for arm in ("candidate", "reference"):
        points = getattr(card.curves, arm) or []
        out.extend(loss_findings(points, ("curves", arm)))
        for index, point in enumerate(points):
            loc: Loc = ("curves", arm, index)
            if point.step >= card.result.steps_per_run:
                out.append(Finding(loc=(*loc, "step"), message=(
                    f"step {point.step} but the run has {card.result.steps_per_run} steps (result.steps_per_run)")))
            peaks = [point.peak_memory_gib, *(point.peak_memory_gib_per_stage or [])]
            if any(p is not None and p > capacity for p in peaks):
                field = "peak_memory_gib" if (point.peak_memory_gib or 0) > capacity else "peak_memory_gib_per_stage"
                out.append(Finding(loc=(*loc, field), message=(
                    f"{max(p for p in peaks if p is not None)} GiB is above the {capacity:g} GiB of one "
                    f"{card.gpu.type}")))
            if point.step_time_s is not None and point.tokens_per_s_per_gpu is not None:
                computed = wl.global_batch * wl.row_tokens / point.step_time_s / card.gpu.count
                if abs(point.tokens_per_s_per_gpu - computed) > RELATIVE_TOLERANCE * computed:
                    out.append(Finding(loc=(*loc, "tokens_per_s_per_gpu"), message=(
                        f"{point.tokens_per_s_per_gpu} but global_batch x row_tokens / step_time_s "
                        f"{point.step_time_s} / {card.gpu.count} GPUs = {computed:.6g}")))
    for phase, value in (card.curves.memory_phases_gib or {}).items():
        if value > capacity:
            out.append(Finding(loc=("curves", "memory_phases_gib", phase), message=(
                f"{value} GiB is above the {capacity:g} GiB of one {card.gpu.type}")))
    return out


def _headline(card: RecipeCard) -> list[Finding]:
    """The headline against the candidate's curve: when the curve holds the time of every step of the window, the
    window's tokens over their summed time (what ``measure`` computed) and their spread are the result's figures."""
    first, last = card.result.window
    if first > last:
        return []  # the window check names it
    times = {p.step: p.step_time_s for p in (card.curves.candidate if card.curves else None) or []}
    window = [times.get(step) for step in range(first, last + 1)]
    if card.result.runs != 1 or any(t is None for t in window):
        return []
    out = []
    computed = card.result.window_tokens / math.fsum(window) / card.gpu.count
    if abs(card.result.tokens_per_s_per_gpu - computed) > RELATIVE_TOLERANCE * computed:
        out.append(Finding(loc=("result", "tokens_per_s_per_gpu"), message=(
            f"{card.result.tokens_per_s_per_gpu} but the candidate's curve gives window_tokens / the window's "
            f"step times / {card.gpu.count} GPUs = {computed:.6g}")))
    cv = 100 * statistics.pstdev(window) / statistics.fmean(window)
    stated_cv = card.result.step_time_cv_percent
    if abs(stated_cv - cv) > max(RELATIVE_TOLERANCE * cv, half_unit(stated_cv)):
        out.append(Finding(loc=("result", "step_time_cv_percent"), message=(
            f"{card.result.step_time_cv_percent} but the candidate's curve gives {cv:.3g} % over steps "
            f"{first}-{last}")))
    return out


def _steps(card: RecipeCard) -> list[Finding]:
    conv = card.correctness.convergence
    if conv is not None and conv.steps > card.result.steps_per_run:
        return [Finding(loc=("correctness", "convergence", "steps"), message=(
            f"{conv.steps} steps checked, but the run had {card.result.steps_per_run} (result.steps_per_run)"))]
    return []


def _hub_revisions(card: RecipeCard) -> list[Finding]:
    out = []
    for loc, source, revision in (
            (("workload", "dataset", "revision"), card.workload.dataset.source, card.workload.dataset.revision),
            (("result", "active_params", "revision"), card.result.active_params.source,
             card.result.active_params.revision)):
        if revision is None and is_hub_source(source):
            out.append(Finding(loc=loc, message=(
                f"source {source.split()[0]!r} is a hub repository: a verified card pins its revision")))
    return out
