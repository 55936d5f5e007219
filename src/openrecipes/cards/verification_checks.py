"""Consistency checks on a schema-valid verification card: its metrics must follow from each other and from the
loss curve, its combinations must be unique, and a verified item must be reproducible (a pinned checkpoint
revision, or a generated checkpoint identified by its hash; zero skipped or NaN steps; every check passing).

The same rounding rules as the recipe card's checks (``checks.half_unit``): a number is compared within the
precision it is written with.
"""

from __future__ import annotations

import datetime

from openrecipes.cards import reference
from openrecipes.cards.bounds import date_findings, loss_findings, throughput_finding
from openrecipes.cards.paths import is_hub_source
from openrecipes.cards.findings import HEX40, Finding, Loc, half_unit
from openrecipes.cards.verification import TRAINING_WORKFLOWS, Item, VerificationCard
from openrecipes.measure.metrics import mfu

TIMING_WINDOW_STEPS = 10  # metrics are averaged over the last 10 steps of the run


def check_verification_card(card: VerificationCard, today: datetime.date | None = None) -> list[Finding]:
    findings: list[Finding] = []
    seen: dict[tuple[str, str, str, str], int] = {}
    for index, item in enumerate(card.items):
        loc: Loc = ("items", index)
        key = item.key()
        if key in seen:
            findings.append(Finding(loc=loc, message=(
                f"combination {' / '.join(key)} is already item {seen[key]}; one item per workflow, hardware, "
                "precision and layout")))
        seen.setdefault(key, index)
        findings.extend(_check_metrics(item, loc))
        findings.extend(_check_bounds(item, loc, today))
        if item.status == "verified":
            findings.extend(_check_verified(item, loc))
    return findings


def _close(written: float, computed: float, relative: float = 0.0) -> bool:
    return abs(written - computed) <= half_unit(written) + relative * abs(computed) + 1e-12


def _check_metrics(item: Item, loc: Loc) -> list[Finding]:
    met, curve, out = item.metrics, item.loss_curve or [], []
    mloc = (*loc, "metrics")
    for index in range(1, len(curve)):
        if curve[index].step <= curve[index - 1].step:
            out.append(Finding(loc=(*loc, "loss_curve", index, "step"), message=(
                f"step {curve[index].step} does not increase on step {curve[index - 1].step}")))
            return out
    if met is None:
        return out
    for name in ("skipped_steps", "nan_steps"):
        if getattr(met, name) > met.steps:
            out.append(Finding(loc=(*mloc, name), message=f"{getattr(met, name)} is more than the {met.steps} steps"))
    if curve:
        # the curve holds the finite losses; every NaN step is the one missing from it
        if len(curve) + met.nan_steps != met.steps:
            out.append(Finding(loc=(*mloc, "steps"), message=(
                f"{met.steps} steps, but the loss curve has {len(curve)} finite points and nan_steps is "
                f"{met.nan_steps}")))
        for name, point in (("initial_loss", curve[0]), ("final_loss", curve[-1])):
            value = getattr(met, name)
            if value is not None and not _close(value, point.loss):
                out.append(Finding(loc=(*mloc, name), message=(
                    f"{value} but the loss curve has {point.loss} at step {point.step}")))
        if met.window is not None:
            first, last = met.window
            wanted = min(TIMING_WINDOW_STEPS, met.steps)
            # a NaN last step is missing from the curve, so the curve may end before the run does
            ends = last == curve[-1].step if met.nan_steps == 0 else last >= curve[-1].step
            if not ends or last - first + 1 != wanted:
                out.append(Finding(loc=(*mloc, "window"), message=(
                    f"{first}..{last} is not the last {wanted} steps of the run (its last step is "
                    f"{curve[-1].step})")))
    out.extend(_check_throughput(item, mloc))
    stages = item.layout.pp
    if met.peak_memory_gib_per_stage is not None and stages is not None \
            and len(met.peak_memory_gib_per_stage) != stages:
        out.append(Finding(loc=(*mloc, "peak_memory_gib_per_stage"), message=(
            f"{len(met.peak_memory_gib_per_stage)} values for layout.pp {stages} pipeline stages")))
    return out


def _check_throughput(item: Item, mloc: Loc) -> list[Finding]:
    met, out = item.metrics, []
    assert met is not None
    tps = met.tokens_per_s_per_gpu
    if met.window is not None and None not in (met.window_tokens, met.step_time_ms, tps):
        steps = met.window[1] - met.window[0] + 1
        seconds = steps * met.step_time_ms / 1000
        computed = met.window_tokens / seconds / item.hardware.count
        # the step time is rounded as written, so the throughput may be off by its relative rounding
        if not _close(tps, computed, relative=half_unit(met.step_time_ms) / met.step_time_ms):
            out.append(Finding(loc=(*mloc, "tokens_per_s_per_gpu"), message=(
                f"{tps} but window_tokens {met.window_tokens} / ({steps} steps x {met.step_time_ms} ms) / "
                f"{item.hardware.count} GPUs = {computed:.3f}")))
    tflops = met.model_tflops_per_gpu
    if tflops is not None and tps is not None and met.active_params is not None:
        dense = mfu(met.active_params, tps, 1e12)  # against 1 TFLOP/s: the dense part in TFLOP/s
        # model FLOPs are 6·N per token plus attention, so never fewer than the dense part
        if tflops + half_unit(tflops) < dense * (1 - half_unit(tps) / tps):
            out.append(Finding(loc=(*mloc, "model_tflops_per_gpu"), message=(
                f"{tflops} is below the dense 6 x N {met.active_params} x {tps} tokens/s/GPU = {dense:.3f} "
                "TFLOP/s")))
    peak = reference.peak_bound(item.hardware.type)  # a GPU's peak, or the CPU bound of the hardware table
    if tflops is not None and peak is not None and tflops * 1e12 > peak:
        out.append(Finding(loc=(*mloc, "model_tflops_per_gpu"), message=(
            f"{tflops} TFLOP/s is above the {peak / 1e12:g} TFLOP/s peak of {item.hardware.type}")))
    if tps is not None and met.active_params is not None and peak is not None:
        out.extend(throughput_finding(met.active_params, tps, peak, (*mloc, "tokens_per_s_per_gpu"),
                                      item.hardware.type))
    return out


def _check_bounds(item: Item, loc: Loc, today: datetime.date | None) -> list[Finding]:
    """What no run could have recorded: negative losses, a date out of range, more memory than the GPU has, a
    layout over another number of GPUs."""
    out = loss_findings(item.loss_curve or [], (*loc, "loss_curve"))
    met = item.metrics
    for name in ("initial_loss", "final_loss"):
        value = getattr(met, name) if met is not None else None
        if value is not None and value < 0:
            out.append(Finding(loc=(*loc, "metrics", name), message=f"{value}: a loss is >= 0"))
    if item.recorded is not None:
        out.extend(date_findings(item.recorded, (*loc, "recorded"), today))
    capacity = None if reference.is_cpu(item.hardware.type) else reference.memory_gib(item.hardware.type)
    peaks = [p for p in (met.peak_memory_gib_per_stage or []) if p is not None] if met is not None else []
    if capacity is not None and peaks and max(peaks) > capacity:
        out.append(Finding(loc=(*loc, "metrics", "peak_memory_gib_per_stage"), message=(
            f"{max(peaks)} GiB is above the {capacity:g} GiB of one {item.hardware.type} (the hardware table)")))
    lay = item.layout
    sizes = (lay.tp, lay.pp, lay.cp, lay.dp)
    if None not in sizes and lay.tp * lay.pp * lay.cp * lay.dp != item.hardware.count:
        out.append(Finding(loc=(*loc, "hardware", "count"), message=(
            f"{item.hardware.count} but layout tp x pp x cp x dp = {lay.tp} x {lay.pp} x {lay.cp} x {lay.dp} = "
            f"{lay.tp * lay.pp * lay.cp * lay.dp} GPUs")))
    return out


def _check_verified(item: Item, loc: Loc) -> list[Finding]:
    out: list[Finding] = []
    ckpt = item.checkpoint
    if ckpt is None:
        out.append(Finding(loc=loc, message=(
            "a verified item needs its checkpoint: a pinned revision, or a generated checkpoint's sha256")))
    elif ckpt.generated:
        if ckpt.sha256 is None:
            out.append(Finding(loc=(*loc, "checkpoint", "sha256"), message=(
                "a verified item's generated checkpoint is identified by its sha256")))
        if is_hub_source(ckpt.source) and (ckpt.revision is None or not HEX40.match(ckpt.revision)):
            # what it was generated from: a hub repository moves unless its revision is pinned
            out.append(Finding(loc=(*loc, "checkpoint", "revision"), message=(
                f"generated from {ckpt.source.split()[0]!r}, a hub repository: a verified item pins the revision "
                f"of its source (40 lowercase hex digits), got {ckpt.revision!r}")))
    elif ckpt.revision is None or not HEX40.match(ckpt.revision):
        out.append(Finding(loc=(*loc, "checkpoint", "revision"), message=(
            f"revision {ckpt.revision!r} is not pinned (40 lowercase hex digits), which a verified item needs")))
    if item.data is not None and item.data.revision is not None and not HEX40.match(item.data.revision):
        out.append(Finding(loc=(*loc, "data", "revision"), message=(
            f"revision {item.data.revision!r} is not pinned (40 lowercase hex digits), which a verified item needs")))
    elif item.data is not None and item.data.revision is None and is_hub_source(item.data.source):
        out.append(Finding(loc=(*loc, "data", "revision"), message=(
            f"source {item.data.source.split()[0]!r} is a hub repository: a verified item pins its revision")))
    if not (item.command or "").strip():
        out.append(Finding(loc=(*loc, "command"), message="a verified item needs its exact command"))
    for index, check in enumerate(item.checks):
        if check.result != "pass":
            out.append(Finding(loc=(*loc, "checks", index, "result"), message="a failing check under a verified item"))
    if item.workflow in TRAINING_WORKFLOWS:
        met = item.metrics
        if met is None:
            out.append(Finding(loc=(*loc, "metrics"), message="a verified training item needs its recorded metrics"))
        else:
            for name in ("skipped_steps", "nan_steps"):
                if getattr(met, name):
                    out.append(Finding(loc=(*loc, "metrics", name), message=(
                        f"{getattr(met, name)}: a verified item has zero skipped and NaN steps")))
    elif not item.checks:
        out.append(Finding(loc=(*loc, "checks"), message=(
            f"a verified {item.workflow} item needs its checkpoint audit among the checks")))
    return out
