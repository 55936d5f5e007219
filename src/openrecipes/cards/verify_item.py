"""``openrecipes card verify-item RUN_DIR --model M --workflow W``: one verification-card item from a run.

A training item is read from the run directory only: the resolved recipe, ``run.json`` (GPUs, versions), the losses
and the NaN and skipped steps from ``metrics.jsonl`` (``config/rundir.py`` readers), the window metrics of the last
10 steps from ``measure``, the rows manifest's hashes, and the last save's hash. A conversion item (import, export)
is read from the converted checkpoint directory and the round trip's audit (``openrecipes convert audit --json``).
The item replaces the one of the same workflow, hardware, precision and layout, or is appended; the other items are
written back as they were, and the file is replaced atomically.
"""

from __future__ import annotations

import datetime
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from openrecipes.cards.step_curves import window_stage_peaks
from openrecipes.cards.verification import TRAINING_WORKFLOWS

LAST_STEPS = 10


@dataclass(frozen=True, kw_only=True)
class ItemOptions:
    run_dir: Path
    model: str                         # the card's file stem: verification/<model>.yaml
    workflow: str
    cards_dir: Path = Path("verification")
    model_name: str | None = None      # published name, for a new card
    description: str | None = None     # for a new card
    status: Literal["verified", "unverified"] = "unverified"
    command: str | None = None         # default: run.json's command
    observed: str | None = None        # written after the generated summary
    hardware: str | None = None        # default: run.json's gpu.type
    precision: str | None = None       # default: the recipe's
    layout: str | None = None          # default: from the recipe's parallel sizes
    checkpoint_source: str | None = None
    checkpoint_revision: str | None = None
    checkpoint_dir: Path | None = None  # a generated checkpoint to identify by its hash
    audit: Path | None = None           # JSON of `openrecipes convert audit --json`
    reference: Path | None = None       # a run of the same rows on another layout: the convergence check
    recorded: datetime.date | None = None


def tree_sha256(directory: Path) -> str:
    """One hash over every file under ``directory``: each relative path and its content's SHA-256, sorted."""
    from openrecipes.utils import sha256_file

    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such checkpoint directory")
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(directory).as_posix()}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def _sig(value: float, digits: int = 6) -> float:
    """A measured number as the card writes it: six significant digits (the checks allow for the rounding)."""
    return float(f"{value:.{digits}g}")


def _stack(versions: dict[str, str | None]) -> dict[str, Any]:
    stack = {"framework": f"openrecipes {versions.get('openrecipes') or 'unknown'}", "pytorch": versions.get("torch"),
             "python": versions.get("python"), "cuda": versions.get("cuda"), "source": "run.json versions"}
    return {key: value for key, value in stack.items() if value}


def _layout_label(sizes: dict[str, int]) -> str:
    return " ".join(f"{name.upper()}{sizes[name]}" for name in ("tp", "pp", "cp", "ep", "dp"))


def _training_item(options: ItemOptions) -> dict[str, Any]:
    from openrecipes.cards.dataset import card_workflow, dataset_block, read_rows_manifest
    from openrecipes.config.recipe import load_recipe
    from openrecipes.config.rundir import (
        ADAPTER_DIR, CHECKPOINTS_DIR, METRICS_FILE, RECIPE_FILE, STEP_DIR_GLOB, decode_metric, read_metrics,
        read_run_info, rows_directory,
    )
    from openrecipes.measure import measure_run_dir
    from openrecipes.utils import shown_step  # the summary is read by people: steps from 1, as the console counts

    run_dir = options.run_dir
    run = read_run_info(run_dir)
    recipe = load_recipe(run_dir / RECIPE_FILE)
    records = read_metrics(run_dir / METRICS_FILE)
    if not records:
        raise ValueError(f"{run_dir / METRICS_FILE}: no steps recorded")
    curve, nonfinite = [], 0
    for record in records:
        loss, grad = (decode_metric(record.fields.get(key)) for key in ("loss", "grad_norm"))
        finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (loss, grad))
        nonfinite += not finite
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            curve.append({"step": record.step, "loss": float(loss)})
    last = records[-1].step
    window = (max(records[0].step, last - LAST_STEPS + 1), last)
    measured = measure_run_dir(run_dir, window=window, gpu_type=options.hardware)
    _refuse_impossible_run(run_dir, run, recipe.layout, records, measured)
    lay = recipe.layout
    sizes = {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp,
             "dp": lay.dp or run.gpu.count // (lay.tp * lay.pp * lay.cp)}
    # with one stage its peak is the loop's peak over all ranks; with more, the loop records each stage's
    if lay.pp > 1:
        peaks = window_stage_peaks(run_dir, window)
        peaks = [round(p, 3) for p in peaks] if peaks is not None else None  # the item's check compares to pp
    else:
        peaks = [round(measured.peak_memory_gib, 3)] if measured.peak_memory_gib is not None else None
    metrics = {
        "steps": len(records), "initial_loss": curve[0]["loss"] if curve else None,
        "final_loss": curve[-1]["loss"] if curve else None, "window": list(window),
        "window_tokens": measured.window_tokens, "step_time_ms": _sig(measured.step_time_mean_s * 1000),
        "model_tflops_per_gpu": _sig(measured.model_tflops_per_gpu) if measured.model_tflops_per_gpu else None,
        "tokens_per_s_per_gpu": _sig(measured.tokens_per_s_per_gpu), "active_params": measured.active_params,
        "peak_memory_gib_per_stage": peaks,
        # the loop applies no update on a step whose loss or gradient norm is not finite: such a step is both
        "skipped_steps": nonfinite, "nan_steps": nonfinite,
    }
    manifest = read_rows_manifest(rows_directory(recipe.data.rows, run_dir))
    _check_workflow(options.workflow, card_workflow(recipe, manifest), lay.cp, run_dir)
    saves = sorted((run_dir / CHECKPOINTS_DIR).glob(STEP_DIR_GLOB)) if (run_dir / CHECKPOINTS_DIR).is_dir() else []
    produced = run_dir / ADAPTER_DIR if recipe.lora is not None else (saves[-1] if saves else None)
    checkpoint = _checkpoint(options, produced, default_source=(
        f"{recipe.model} ({recipe.init} init, seed {recipe.seed}); "
        f"the hash is of what the run wrote: {produced.relative_to(run_dir).as_posix() if produced else 'nothing'}"))
    checks = [{"name": "finite steps", "result": "pass" if nonfinite == 0 else "fail",
               "detail": f"{len(records) - nonfinite} of {len(records)} steps with a finite loss and gradient norm"}]
    if options.reference is not None:
        checks.append(_convergence_check(run_dir, Path(options.reference), manifest["rows_sha256"]))
    summary = (f"{len(records)} steps recorded with {nonfinite} NaN or skipped; loss "
               f"{metrics['initial_loss']:.4f} at step {shown_step(curve[0]['step'])} to {metrics['final_loss']:.4f} "
               f"at step {shown_step(curve[-1]['step'])}; steps {shown_step(window[0])}-{shown_step(window[1])} "
               f"average {metrics['step_time_ms']:,.1f} ms and "
               f"{metrics['tokens_per_s_per_gpu']:,.1f} tokens/s/GPU on {run.gpu.count} x {measured.gpu_type}."
               if curve else f"{len(records)} steps recorded, none with a finite loss.")
    return {
        "hardware": {"type": measured.gpu_type, "count": run.gpu.count},
        "precision": options.precision or recipe.card_precision(),
        "layout": {"label": options.layout or _layout_label(sizes), **sizes},
        "command": options.command or run.command,
        "recipe": (run_dir / RECIPE_FILE).read_text(),
        "metrics": {key: value for key, value in metrics.items() if value is not None},
        "loss_curve": curve or None, "checks": checks, "summary": summary, "stack": _stack(run.versions),
        "checkpoint": checkpoint,
        "data": {"source": dataset_block(manifest, run.versions.get("openrecipes") or "unknown")["source"],
                 "hashes": {"rows": manifest["rows_sha256"], "parquet": manifest["parquet_sha256"]}},
    }


def _refuse_impossible_run(run_dir: Path, run: Any, layout: Any, records: list[Any], measured: Any) -> None:
    """Refuse a run directory no run could have written: run.json's world size against its GPUs and the recipe's
    layout, and a step faster than 6 x N x its tokens at the hardware table's peak (the CPU bound for cpu)."""
    from openrecipes.cards import reference
    from openrecipes.config.layout import layout_problems, with_world_size
    from openrecipes.config.rundir import METRICS_FILE, RUN_FILE
    from openrecipes.measure.metrics import mfu

    world = run.world_size or run.gpu.count
    if run.world_size is not None and run.world_size != run.gpu.count:
        raise ValueError(f"{run_dir / RUN_FILE}: world_size {run.world_size} but gpu.count {run.gpu.count}")
    sized = [p for p in layout_problems(with_world_size(layout, world), world_size=world) if "world size" in p.message]
    if sized:
        raise ValueError(f"{run_dir / RUN_FILE}: gpu.count {world} disagrees with the recipe's "
                         f"layout.{sized[0].field}: {sized[0].message}")
    peak = reference.peak_bound(measured.gpu_type)
    if peak is None or not measured.active_params or not measured.window_steps:
        return
    tokens_per_step = measured.window_tokens / measured.window_steps
    # the least time a step takes: its model FLOPs on every GPU at the peak, i.e. an MFU of 1
    fastest = tokens_per_step / measured.gpus * mfu(measured.active_params, 1.0, peak)
    for record in records:
        seconds = record.fields.get("step_time_s")
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds < fastest:
            raise ValueError(
                f"{run_dir / METRICS_FILE}:{record.line}: step {record.step}: step_time_s {seconds:.3g} is below "
                f"{fastest:.3g} s, the time 6 x N {measured.active_params} x {tokens_per_step:g} tokens takes on "
                f"{measured.gpus} x {measured.gpu_type} at {peak:.4g} FLOP/s each (the hardware table)")


def _convergence_check(run_dir: Path, reference: Path, rows_sha256: str) -> dict[str, Any]:
    """`verify convergence` of the run against a reference run on the same rows (another layout, one process)."""
    from openrecipes.cards.reference_run import check_reference_run
    from openrecipes.config.recipe import load_recipe
    from openrecipes.config.rundir import RECIPE_FILE
    from openrecipes.verify.convergence import Thresholds, check_convergence
    from openrecipes.verify.curves import read_loss_curve

    check_reference_run(run_dir, reference, candidate_rows_sha256=rows_sha256,
                        reference_recipe=load_recipe(reference / RECIPE_FILE))
    report = check_convergence(read_loss_curve(run_dir), read_loss_curve(reference), Thresholds())
    if report.correlation is None or report.final_loss_difference is None:
        detail = "; ".join(report.problems[:3]) or "no comparable steps"
    else:
        detail = (f"correlation {report.correlation:.7g}, final loss difference {report.final_loss_difference:.3g}, "
                  f"{report.pointwise_failures} pointwise failures over {len(report.steps)} steps")
    ref = load_recipe(reference / RECIPE_FILE).layout
    return {"name": f"convergence against {reference.name} (TP{ref.tp} PP{ref.pp} CP{ref.cp} EP{ref.ep})",
            "result": "pass" if report.passed else "fail", "detail": f"openrecipes verify convergence: {detail}"}


def _check_workflow(claimed: str, trained: str, cp: int, run_dir: Path) -> None:
    """The workflow an item claims must be the one the run trained (``card_workflow``: its rows, its adapters, and
    context parallelism for long-context SFT)."""
    from openrecipes.cards.dataset import LONG_CONTEXT_ROW_TOKENS

    if claimed != trained:
        hint = (" (long-context SFT is SFT rows with context parallelism, cp > 1, or rows of at least "
                f"{LONG_CONTEXT_ROW_TOKENS:,} tokens)") if "long-context-sft" in (
            claimed, trained) else ""
        raise ValueError(f"--workflow {claimed}, but {run_dir} trained {trained} with layout.cp {cp} (its rows' "
                         f"manifest and recipe say so){hint}")


def _checkpoint(options: ItemOptions, produced: Path | None, *, default_source: str) -> dict[str, Any]:
    if options.checkpoint_revision is not None:
        return {"source": options.checkpoint_source or default_source, "revision": options.checkpoint_revision}
    target = options.checkpoint_dir or produced
    if target is None:
        return {"source": options.checkpoint_source or default_source}
    return {"source": options.checkpoint_source or default_source, "generated": True,
            "sha256": tree_sha256(Path(target))}


def _conversion_item(options: ItemOptions) -> dict[str, Any]:
    from openrecipes.utils import read_json

    if options.audit is None:
        raise ValueError(f"--audit FILE.json (`openrecipes convert audit --json`) is needed for a {options.workflow} "
                         "item: it is the round trip's check")
    if options.precision is None:
        raise ValueError(f"--precision is needed for a {options.workflow} item (the dtype the checkpoint holds)")
    audit = read_json(options.audit)
    if not isinstance(audit, dict) or "passed" not in audit or "compared" not in audit:
        raise ValueError(f"{options.audit}: not the JSON of `openrecipes convert audit --json`")
    lists = {key: len(audit.get(key) or []) for key in ("missing", "extra", "reshaped", "dtype_changed",
                                                       "promoted", "differing")}
    detail = (f"{audit['compared']} tensors compared, {audit.get('exact')} exact; missing {lists['missing']}, extra "
              f"{lists['extra']}, reshaped {lists['reshaped']}, dtype changed {lists['dtype_changed']}, promoted to "
              f"fp32 {lists['promoted']}, differing {lists['differing']} (max abs difference "
              f"{audit.get('max_abs_diff')}, atol {audit.get('atol')})")
    if not options.run_dir.is_dir():
        raise FileNotFoundError(f"{options.run_dir}: no such checkpoint directory")
    checkpoint = _checkpoint(options, options.checkpoint_dir or options.run_dir,
                             default_source=f"{options.run_dir.as_posix()}")
    return {
        "hardware": {"type": options.hardware or "cpu", "count": 1},
        "precision": options.precision,
        "layout": {"label": options.layout or "one process"},
        "command": options.command,
        "checks": [{"name": "checkpoint audit", "result": "pass" if audit["passed"] else "fail", "detail": detail}],
        "summary": f"Round trip audited: {detail}.", "checkpoint": checkpoint,
    }


def build_item(options: ItemOptions) -> dict[str, Any]:
    """The item's fields, ready for the card (a plain mapping in the card's field order)."""
    made = _training_item(options) if options.workflow in TRAINING_WORKFLOWS else _conversion_item(options)
    summary = made.pop("summary")
    item: dict[str, Any] = {"workflow": options.workflow, "hardware": made.pop("hardware"),
                            "precision": made.pop("precision"), "layout": made.pop("layout"), "status": options.status,
                            "command": made.pop("command")}
    item.update(made)
    item["observed"] = summary + (f" {options.observed}" if options.observed else "")
    item["recorded"] = options.recorded or datetime.date.today()
    return {key: value for key, value in item.items() if value is not None or key == "command"}


def update_card(options: ItemOptions) -> tuple[Path, int, list[Any]]:
    """Write the item into ``cards_dir/<model>.yaml`` atomically; returns (file, item index, the item's errors).

    Nothing is written when the updated item has an error: the card on disk stays as it was.
    """
    import pydantic

    from openrecipes.cards.new import dump_card
    from openrecipes.cards.validate import CardError, Problem, schema_problems, to_problem
    from openrecipes.cards.verification import VerificationCard
    from openrecipes.cards.verification_checks import check_verification_card
    from openrecipes.cards.verification_load import is_verification_data
    from openrecipes.config.safe_yaml import load_plain_yaml, load_plain_yaml_file
    from openrecipes.utils import atomic_write_text

    if not options.model or "/" in options.model or options.model.startswith("."):
        raise ValueError(f"--model {options.model!r}: a card name such as qwen3-moe-tiny (the file verification/"
                         "<model>.yaml), not a path")
    path = Path(options.cards_dir) / f"{options.model}.yaml"
    if path.exists():
        data, _, _ = load_plain_yaml_file(path)
        if not is_verification_data(data):
            raise ValueError(f"{path}: not a verification card (kind: verification), so it is not replaced")
    else:
        data = {"schema_version": 1, "kind": "verification", "model": options.model_name or options.model,
                "model_id": options.model,
                "description": options.description or f"Workflows of {options.model_name or options.model} as "
                                                      "recorded by openrecipes runs.", "engine": "openrecipes",
                "items": []}
    item = build_item(options)
    key = (item["workflow"], item["hardware"]["type"], item["precision"], item["layout"]["label"])
    items = list(data.get("items") or [])
    index = next((i for i, old in enumerate(items) if isinstance(old, dict) and (
        old.get("workflow"), (old.get("hardware") or {}).get("type"), old.get("precision"),
        (old.get("layout") or {}).get("label")) == key), len(items))
    items[index:index + 1] = [item]
    data["items"] = items
    text = dump_card(data)
    source = str(path)
    # validate what would be written, from its text, so the line numbers are those of the new file
    parsed, lines = load_plain_yaml(text, source=source)
    try:
        card = VerificationCard.model_validate(parsed)
    except pydantic.ValidationError as error:
        raise CardError(schema_problems(error, source, lines)) from None
    prefix = ("items", index)
    errors: list[Problem] = [to_problem(f, source, lines) for f in check_verification_card(card)
                             if f.severity == "error" and tuple(f.loc[:2]) == prefix]
    if not errors:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    return path, index, errors
