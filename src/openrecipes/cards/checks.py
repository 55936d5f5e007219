"""Consistency checks on a schema-valid card: the numbers must agree with each other.

Each check returns findings as (path, message, severity); `validate.py` turns paths into lines.
Numbers published rounded are compared within the rounding their written precision allows.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from openrecipes.cards import reference
from openrecipes.cards.bounds import card_peak_bound, check_card_bounds, throughput_finding
from openrecipes.cards.findings import HEX40, Finding, Loc, half_unit
from openrecipes.cards.schema import RecipeCard
from openrecipes.cards.tuning_checks import check_tuning
from openrecipes.config.layout import LayoutWorkload, layout_problems
from openrecipes.measure.metrics import mfu

_TEXT_REVISION = re.compile(r"\brevision\s+([^\s;,()]+)")

# the convergence thresholds of the check the cards cite (Megatron-Bridge pipeline defaults)
MIN_CORRELATION = 0.95
MAX_FINAL_LOSS_DIFFERENCE = 0.05
MAX_POINTWISE_FAILURE_SHARE = 0.1
SKIPPED_SHARE = 0.2


def check_card(card: RecipeCard) -> list[Finding]:
    findings: list[Finding] = []
    for check in (_check_layout, _check_window, _check_mfu, _check_price, _check_correctness,
                  _check_curves, _check_patches, check_card_bounds, check_tuning):
        findings.extend(check(card))
    if card.status == "verified":
        findings.extend(_check_verified(card))
    return findings


# where a layout problem's field sits on a card
_CARD_LOC: dict[str, Loc] = {"dp": ("layout",), "pp_first_stage_layers": ("layout", "layer_split"),
                             "pp_last_stage_layers": ("layout", "layer_split")}


def _check_layout(card: RecipeCard) -> list[Finding]:
    lay, out = card.layout, []
    layers = reference.model_layers(card.model)
    workload = LayoutWorkload(global_batch=card.workload.global_batch, row_tokens=card.workload.row_tokens)
    for problem in layout_problems(lay.layout_config(card.workload.row_tokens), world_size=card.gpu.count,
                                   model=reference.model_layout(card.model), workload=workload):
        message = problem.message
        if problem.field == "dp" and "world size" in message:
            message += f" (gpu.count is {card.gpu.count})"
        elif problem.field in ("pp", "pp_first_stage_layers", "pp_last_stage_layers"):
            message += f" for the {layers} layers of {card.model}" + ("; give layout.layer_split"
                                                                       if problem.field == "pp" else "")
        out.append(Finding(loc=_CARD_LOC.get(problem.field, ("layout", problem.field)), message=message))
    if layers is None:
        out.append(Finding(loc=("layout", "layer_split"), severity="note", message=(
            f"layer count of model {card.model!r} unknown; layer split not checked")))
    per_dp, rest = divmod(card.workload.global_batch, lay.dp)  # a rest: the layout rules name dp
    if not rest and per_dp % lay.rows_per_microbatch:
        out.append(Finding(loc=("layout", "rows_per_microbatch"), message=(
            f"global_batch {card.workload.global_batch} is not a whole number of "
            f"{lay.rows_per_microbatch}-row microbatches on each of dp {lay.dp} ranks")))
    gpu = card.gpu
    if gpu.count > gpu.per_node and gpu.count % gpu.per_node:
        out.append(Finding(loc=("gpu", "count"), message=(
            f"{gpu.count} GPUs is not a whole number of {gpu.per_node}-GPU nodes")))
    build = card.workload.dataset.build
    if build is not None and build.row_tokens != card.workload.row_tokens:
        out.append(Finding(loc=("workload", "dataset", "build", "row_tokens"), message=(
            f"{build.row_tokens} differs from workload.row_tokens {card.workload.row_tokens}")))
    return out


def _check_window(card: RecipeCard) -> list[Finding]:
    res, out = card.result, []
    start, end = res.window
    if start > end or end >= res.steps_per_run:
        out.append(Finding(loc=("result", "window"), message=(
            f"window {start}..{end} must satisfy start <= end < steps_per_run ({res.steps_per_run})")))
        return out
    expected = (end - start + 1) * card.workload.global_batch * card.workload.row_tokens
    if res.window_tokens != expected:
        out.append(Finding(loc=("result", "window_tokens"), message=(
            f"{res.window_tokens} != (window end {end} - start {start} + 1) x global_batch "
            f"{card.workload.global_batch} x row_tokens {card.workload.row_tokens} = {expected}")))
    if start == end and res.runs == 1 and res.step_time_cv_percent > 0:
        out.append(Finding(loc=("result", "step_time_cv_percent"), message=(
            f"{res.step_time_cv_percent} % over the one step {start} of result.window: one step time has no spread")))
    if start == 0 and card.status == "verified":
        out.append(Finding(loc=("result", "window"), message=(
            "the window starts at step 0, whose time holds the warm-up (compilation, the allocator's first "
            "allocations): a verified card measures after it")))
    return out


def _peak(card: RecipeCard) -> float | None:
    return card.gpu.peak_bf16_dense_flops or reference.peak_flops(card.gpu.type)


def _check_mfu(card: RecipeCard) -> list[Finding]:
    res = card.result
    bound = card_peak_bound(card)
    if bound is not None:  # faster than the hardware's peak: the throughput (or N, or the GPU) is wrong
        too_fast = throughput_finding(res.active_params.count, res.tokens_per_s_per_gpu, bound,
                                      ("result", "tokens_per_s_per_gpu"), card.gpu.type)
        if too_fast:
            return too_fast
    peak = _peak(card)
    if res.mfu is None:
        return []
    if peak is None:
        return [Finding(loc=("result", "mfu"), severity="note", message=(
            f"no peak FLOP/s known for GPU {card.gpu.type!r}; MFU not checked"))]
    computed = mfu(res.active_params.count, res.tokens_per_s_per_gpu, peak)
    # within the written rounding, but never looser than 1% of the value
    tolerance = min(half_unit(res.mfu), 0.01 * computed) + 1e-12
    if abs(computed - res.mfu) > tolerance:
        return [Finding(loc=("result", "mfu"), message=(
            f"{res.mfu} but 6 x N {res.active_params.count} x tokens/s/GPU "
            f"{res.tokens_per_s_per_gpu} / peak {peak:.4g} = {computed:.6f}"))]
    return []


def _check_price(card: RecipeCard) -> list[Finding]:
    res = card.result
    usd = res.usd_per_million_tokens
    if usd is None:
        return []
    loc: Loc = ("result", "usd_per_million_tokens")
    # money is written to the cent at most
    tolerance = min(half_unit(usd), 0.005) + 1e-12
    tokens_per_hour_millions = res.tokens_per_s_per_gpu * 3600 / 1e6
    price = res.usd_per_gpu_hour or reference.price_for_instance(card.gpu.instance)
    if price is not None:
        computed = price / tokens_per_hour_millions
        if abs(computed - usd) > tolerance:
            return [Finding(loc=loc, message=(
                f"{usd} but {price} USD/GPU-hour / ({res.tokens_per_s_per_gpu} tokens/s/GPU x 3600)"
                f" x 1e6 = {computed:.4f}"))]
        return []
    band = reference.PLAUSIBLE_PRICE_BAND.get(card.gpu.type.strip().upper())
    if band is None:
        return [Finding(loc=loc, severity="note", message=(
            f"no price known for instance {card.gpu.instance!r} or GPU {card.gpu.type!r}; "
            "$/1M tokens not checked"))]
    low = (usd - tolerance) * tokens_per_hour_millions
    high = (usd + tolerance) * tokens_per_hour_millions
    if high < band[0] or low > band[1]:
        return [Finding(loc=loc, message=(
            f"{usd} implies {low:.3f}-{high:.3f} USD per GPU-hour, outside the plausible "
            f"{band[0]}-{band[1]} for {card.gpu.type}"))]
    return []


def _check_correctness(card: RecipeCard) -> list[Finding]:
    cor, out = card.correctness, []
    conv = cor.convergence
    if conv is not None and conv.result == "pass":
        checked = conv.steps - int(SKIPPED_SHARE * conv.steps)
        if conv.correlation < MIN_CORRELATION:
            out.append(Finding(loc=("correctness", "convergence", "correlation"), message=(
                f"{conv.correlation} is below {MIN_CORRELATION}, yet the check says pass")))
        if conv.final_loss_difference > MAX_FINAL_LOSS_DIFFERENCE:
            out.append(Finding(loc=("correctness", "convergence", "final_loss_difference"), message=(
                f"{conv.final_loss_difference} is above {MAX_FINAL_LOSS_DIFFERENCE}, "
                "yet the check says pass")))
        if checked > 0 and conv.pointwise_failures / checked > MAX_POINTWISE_FAILURE_SHARE:
            out.append(Finding(loc=("correctness", "convergence", "pointwise_failures"), message=(
                f"{conv.pointwise_failures} of {checked} checked steps failing is above "
                f"{MAX_POINTWISE_FAILURE_SHARE:.0%}, yet the check says pass")))
    if cor.result == "pass":
        failed = [i for i, t in enumerate(cor.component_tests) if t.result != "pass"]
        for index in failed:
            out.append(Finding(loc=("correctness", "component_tests", index, "result"),
                               message="a failing component test under correctness.result pass"))
        if conv is not None and conv.result != "pass":
            out.append(Finding(loc=("correctness", "convergence", "result"),
                               message="a failing convergence check under correctness.result pass"))
        if cor.configuration == "fail":
            out.append(Finding(loc=("correctness", "configuration"),
                               message="a failing configuration check under correctness.result pass"))
    return out


def _check_curves(card: RecipeCard) -> list[Finding]:
    if card.curves is None:
        return []
    out = []
    for arm in ("candidate", "reference"):
        points = getattr(card.curves, arm)
        for index in range(1, len(points or [])):
            if points[index].step <= points[index - 1].step:
                out.append(Finding(loc=("curves", arm, index, "step"), message=(
                    f"step {points[index].step} does not increase on step {points[index - 1].step}")))
                break
    return out


def _check_verified(card: RecipeCard) -> list[Finding]:
    out: list[Finding] = []
    pinned: list[tuple[Loc, str | None]] = [
        (("workload", "dataset", "revision"), card.workload.dataset.revision),
        (("result", "active_params", "revision"), card.result.active_params.revision),
    ]
    build = card.workload.dataset.build
    if build is not None:
        for match in _TEXT_REVISION.finditer(build.tokenizer):
            pinned.append((("workload", "dataset", "build", "tokenizer"), match.group(1)))
    for loc, revision in pinned:
        if revision is not None and not HEX40.match(revision):
            out.append(Finding(loc=loc, message=(
                f"revision {revision!r} is not pinned (40 lowercase hex digits), "
                "which a verified card needs")))
    cor = card.correctness
    if cor.result != "pass":
        out.append(Finding(loc=("correctness", "result"),
                           message=f"a verified card needs pass, got {cor.result!r}"))
    if cor.convergence is None:
        out.append(Finding(loc=("correctness", "convergence"),
                           message="a verified card needs a convergence check"))
    elif cor.convergence.result != "pass":
        out.append(Finding(loc=("correctness", "convergence", "result"),
                           message="a verified card needs a passing convergence check"))
    if not card.run.strip():
        out.append(Finding(loc=("run",), message="a verified card needs the run script"))
    # tokens/s must be checkable against a peak (the MFU check); a CPU run states no MFU
    if _peak(card) is None and not reference.is_cpu(card.gpu.type):
        out.append(Finding(loc=("gpu", "type"), message=(
            f"GPU {card.gpu.type!r} is not in the hardware table: a verified card states gpu.peak_bf16_dense_flops")))
    return out


def _check_patches(card: RecipeCard) -> list[Finding]:
    """A patch is a file beside the card in the repository: never an absolute path or one leading out of it."""
    out = []
    for index, patch in enumerate(card.patches):
        path = PurePosixPath(patch.path.replace("\\", "/"))
        if path.is_absolute() or ".." in path.parts or ":" in patch.path:
            out.append(Finding(loc=("patches", index, "path"), message=(
                f"{patch.path!r} leaves the repository; give a path relative to the card, inside it")))
    return out
