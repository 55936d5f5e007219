"""``openrecipes card new RUN_DIR --reference RUN_DIR ...``: a recipe card from a measured run.

The card is assembled from files only: the candidate run's ``recipe.yaml``, ``run.json`` and
``metrics.jsonl`` (measured over the window), the reference run's loss curve and recipe (the
convergence check and the numerics rules), the rows manifest, and optional component-test JSON
written by ``openrecipes verify optimizer --json``. Numbers are written as computed, unrounded, so
the card's figures equal ``openrecipes measure``'s.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from openrecipes.config.layout import rows_per_microbatch, stage_layer_counts
from openrecipes.cards.dataset import ROWS_TEXT, card_workflow, dataset_block, read_rows_manifest, rows_dir_of
from openrecipes.config.rundir import PROFILE_FILE
from openrecipes.utils import shown_step


@dataclass(frozen=True, kw_only=True)
class NewCardOptions:
    run_dir: Path
    reference: Path
    out: Path
    author: str
    author_url: str | None = None
    window: tuple[int, int] | None = None  # None: the window the run has (measure's default)
    gpu_type: str | None = None
    gpu_memory_gb: float | None = None
    gpus_per_node: int | None = None
    instance: str | None = None
    usd_per_gpu_hour: float | None = None
    status: Literal["verified", "unverified"] = "unverified"
    component_tests: tuple[Path, ...] = ()
    model_name: str | None = None
    overwrite: bool = False
    notes: tuple[str, ...] = ()  # written first in the card's notes (e.g. by openrecipes tune)
    tuning: dict[str, Any] | None = None  # the card's tuning block (openrecipes tune)
    run_command: str | None = None  # the card's run: (default: the run's own command from run.json)
    recipe: Any = None  # the recipe the card holds and its run trains (default: the measured run's own)
    # where the run directories lie (openrecipes tune --out): paths under it are written relative to it and any other
    # absolute machine path by its last part, so the card holds none and validates as a catalog card
    output_dir: Path | None = None
    # the card's recipe measured again (openrecipes tune's remeasured samples, the run's own measurement first): the
    # result's tokens/s/GPU is their median and ``runs`` their count, so the card quotes the figure its tuning does
    samples_tokens_per_s: tuple[float, ...] = ()


class _CardDumper(yaml.SafeDumper):
    """Plain YAML: no anchors or aliases (the card loader refuses them), block text for multi-line strings."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


def _represent_dict(dumper: yaml.SafeDumper, data: dict) -> yaml.Node:
    # curve points one per line: {step: 3, loss: 2.5}
    flow = list(data) == ["step", "loss"]
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=flow or None)


_CardDumper.add_representer(str, _represent_str)
_CardDumper.add_representer(dict, _represent_dict)


def dump_card(data: dict[str, Any], header: str = "") -> str:
    return header + yaml.dump(data, Dumper=_CardDumper, sort_keys=False, width=110, allow_unicode=True)


def _cpu_run_memory_gb(run: Any, gpu_type: str) -> float | None:
    """A CPU run's device memory: the host's, as run.json's gpu.memory_gb records it (runs before it was recorded:
    this host's, where the card is written); None for a GPU type."""
    from openrecipes.config.hardware import is_cpu
    from openrecipes.utils import host_memory_bytes

    if not is_cpu(gpu_type):
        return None
    recorded = getattr(run.gpu, "memory_gb", None)
    if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and recorded > 0:
        return float(recorded)
    return round(host_memory_bytes() / 1e9, 1)


def describe_layout(recipe: Any, row_tokens: int) -> str:
    lay, rpm = recipe.layout, rows_per_microbatch(recipe.layout, row_tokens)
    recompute = recipe.recompute
    recompute_text = ("no recompute" if recompute.granularity == "none" else
                      f"{recompute.granularity} recompute ({recompute.method}, {recompute.num_layers} layer(s))")
    offload = (f"optimizer offload {recipe.offload.fraction:g} ({'overlapped' if recipe.offload.overlap else 'serial'}"
               " copies)" if recipe.offload.fraction else "no offload")
    master = {"param": "fp32 parameters", "fp32": "fp32 masters", "remainder": "int16 remainders"}
    return (f"TP {lay.tp}, PP {lay.pp}, CP {lay.cp}, EP {lay.ep}, ETP {lay.etp}, DP {lay.dp}"
            f"{', sequence parallel' if lay.sequence_parallel else ''}; {rpm} row(s) of {row_tokens:,} tokens "
            f"per microbatch (max {lay.max_tokens_per_gpu:,} tokens/GPU); {recompute_text}; Adam with "
            f"{master[recipe.optimizer_master()]}, {offload}; attention kernel {recipe.kernels.attention}, "
            f"expert kernel {recipe.kernels.experts}")


def layout_block(recipe: Any, row_tokens: int, num_layers: int) -> dict[str, Any]:
    lay = recipe.layout
    split = None
    if lay.pp > 1 and (lay.pp_first_stage_layers or lay.pp_last_stage_layers):
        counts = stage_layer_counts(lay, num_layers)
        split = {"first": counts[0], "last": counts[-1]}
    recompute = recipe.recompute
    return {
        "label": lay.label(),
        "summary": describe_layout(recipe, row_tokens),
        "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp,
        "sequence_parallel": lay.sequence_parallel,
        "layer_split": split,
        "max_tokens_per_gpu": lay.max_tokens_per_gpu,
        "rows_per_microbatch": rows_per_microbatch(lay, row_tokens),
        "recompute": None if recompute.granularity == "none" else {
            "granularity": recompute.granularity,
            "method": recompute.method if recompute.granularity == "full" or recompute.method == "block" else None,
            "num_layers": recompute.num_layers if recompute.granularity == "full" or recompute.method == "block"
            else None},
        "offload": {"optimizer_fraction": recipe.offload.fraction, "overlap_d2h_h2d": recipe.offload.overlap}
        if recipe.offload.fraction else None,
        "dispatcher": "alltoall" if lay.ep > 1 else "local (EP 1, no token exchange)",
    }


def component_test_block(path: Path) -> dict[str, Any]:
    """One card component test from the JSON of ``openrecipes verify optimizer --json``."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--component-test {path}: no such file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--component-test {path}: not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--component-test {path}: expected the JSON object of `openrecipes verify optimizer --json`")
    for key, kind in (("passed", bool), ("summary", str), ("device", str), ("shape", dict),
                      ("hyperparameters", dict)):
        if not isinstance(data.get(key), kind):
            raise ValueError(f"--component-test {path}: field '{key}' missing or not a {kind.__name__}")
    shape, hyper = data["shape"], data["hyperparameters"]
    try:
        shape_text = (f"one MoE layer: hidden {shape['hidden']}, {shape['experts']} experts, top-{shape['top_k']}, "
                      f"expert FFN {shape['ffn']}, EP {shape.get('ep', 1)}, {shape['tokens']:,} tokens")
        hyper_text = (f"lr {hyper['lr']:g}, betas {tuple(hyper['betas'])}, eps {hyper['eps']:g}, "
                      f"weight decay {hyper['weight_decay']:g}")
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"--component-test {path}: shape or hyperparameters incomplete ({error})") from None
    # the test records no date of its own: the file's modification date is when it was written
    date = datetime.date.fromtimestamp(path.stat().st_mtime)
    device = data["device"]
    return {
        "test": f"precision-aware Adam on the {device} (with and without CPU offload) against an FP64 reference "
                "(openrecipes verify optimizer)",
        "shape": shape_text,
        "gpu": device if device == "cpu" else f"{device} (GPU model not recorded by the test)",
        "date": date,
        "result": "pass" if data["passed"] else "fail",
        "detail": data["summary"],
        "note": f"{path.name}: forward/backward of the bf16 arms in {data.get('compute', 'fp64')}; {hyper_text}",
    }


def convergence_block(report: Any, candidate: Path, reference: Path) -> dict[str, Any] | None:
    """The card's convergence block; None when the check could not produce its numbers (it then failed)."""
    if report.correlation is None or report.final_loss_difference is None or report.pointwise_failures is None:
        return None
    note = (f"candidate arm: {candidate}; reference arm: {reference}; Megatron-Bridge validate_convergence "
            f"checks at openrecipes' default thresholds, first {len(report.skipped_steps)} step(s) left out of "
            "the correlation, pointwise and outlier checks")
    if report.problems:
        note += "; problems: " + "; ".join(report.problems[:5])
    return {
        "steps": len(report.steps),
        "result": "pass" if report.passed else "fail",
        # a perfect correlation can round to just above 1; the schema bounds it
        "correlation": max(-1.0, min(1.0, report.correlation)),
        "final_loss_difference": report.final_loss_difference,
        "pointwise_failures": report.pointwise_failures,
        "note": note,
    }


def _correctness(rules: Any, convergence: dict[str, Any] | None, conv_report: Any, tests: list[dict[str, Any]],
                 reference_text: str) -> dict[str, Any]:
    failing = []
    if not rules.passed:
        failing.append("numerics rules (" + ", ".join(d.path for d in rules.numerics) + " differ)")
    if convergence is None or convergence["result"] != "pass":
        failed_checks = [c.name for c in conv_report.checks if not c.passed]
        failing.append(f"convergence check ({', '.join(failed_checks)})")
    failing += [f"component test {i + 1}" for i, t in enumerate(tests) if t["result"] != "pass"]
    passed_parts = ["numerics rules", f"{len(conv_report.steps)}-step convergence check"]
    if tests:
        passed_parts.append(f"{len(tests)} component test(s)")
    from openrecipes.verify.rules import summary_text

    return {
        "result": "fail" if failing else "pass",
        "summary": ("failed: " + "; ".join(failing)) if failing else "passed: " + ", ".join(passed_parts),
        "reference": reference_text,
        "configuration": "pass" if rules.passed else "fail",
        "component_tests": tests,
        "convergence": convergence,
        "rules": summary_text(rules),
    }


def _model_name(recipe: Any, given: str | None) -> str:
    if given:
        return given
    name = Path(recipe.model).name if os.sep in recipe.model else recipe.model
    if recipe.model_overrides:
        # not the registry model any more: say so, so the layer-count check does not assume it
        name += " with " + ", ".join(f"{k}={v}" for k, v in sorted(recipe.model_overrides.items()))
    return name


def build_card_data(options: NewCardOptions) -> dict[str, Any]:
    """Every field of the card, from the two run directories and the options."""
    from openrecipes.cards.reference_run import check_reference_run
    from openrecipes.measure import measure_run_dir
    from openrecipes.config.rundir import RUN_FILE, read_run_info
    from openrecipes.config.recipe import dump_recipe, load_recipe
    from openrecipes.verify.convergence import Thresholds, check_convergence
    from openrecipes.cards.step_curves import curve_points, memory_phases
    from openrecipes.verify.curves import read_loss_curve
    from openrecipes.verify.rules import check_rules, recipe_path

    run_dir, ref_dir = Path(options.run_dir), Path(options.reference)
    run = read_run_info(run_dir)
    run_origin = run_dir / RUN_FILE
    recipe = load_recipe(recipe_path(run_dir))
    reference_recipe = load_recipe(recipe_path(ref_dir))
    measured = measure_run_dir(run_dir, window=options.window, gpu_type=options.gpu_type,
                               usd_per_gpu_hour=options.usd_per_gpu_hour, instance=options.instance)
    manifest = read_rows_manifest(rows_dir_of(recipe, run_dir))
    check_reference_run(run_dir, ref_dir, candidate_rows_sha256=manifest["rows_sha256"],
                        reference_recipe=reference_recipe)
    row_tokens = int(manifest["row_tokens"])
    versions = run.versions
    started = str(run.require("started", run_origin))
    try:
        measured_on = datetime.date.fromisoformat(started[:10])
    except ValueError:
        raise ValueError(f"{run_origin}: 'started' is not an ISO date-time: {started!r}") from None
    gpu = _gpu_block(options, run, measured)

    candidate_curve, reference_curve = read_loss_curve(run_dir), read_loss_curve(ref_dir)
    conv_report = check_convergence(candidate_curve, reference_curve, Thresholds())
    rules = check_rules(run_dir, ref_dir)
    tests = [component_test_block(Path(p)) for p in options.component_tests]
    reference_text = (f"the recipe of run {ref_dir} ({reference_recipe.name}): "
                      f"{describe_layout(reference_recipe, row_tokens)}; "
                      + ("model, rows, optimizer and schedule are the same in both recipes" if rules.passed
                         else "it differs in numerics-affecting fields: "
                         + ", ".join(d.path for d in rules.numerics)))

    notes_text = _notes_text(options, run_dir, started, measured)
    result = {**_result_block(measured, gpu["type"], options.samples_tokens_per_s),
              "active_params": {"count": measured.active_params,
                                "source": f"openrecipes model config {recipe.model} (run.json model.active_params)",
                                "revision": None},
              "measured": measured_on, "steps_per_run": int(run.require("steps", run_origin)),
              "profiler": (run_dir / PROFILE_FILE).exists()}

    return {
        "schema_version": 1,
        "model": _model_name(recipe, options.model_name),
        "gpu": gpu,
        "author": {"name": options.author, "url": options.author_url},
        "status": options.status,
        "stack": {"framework": f"openrecipes {versions.get('openrecipes', '(version not recorded)')}",
                  "pytorch": versions.get("torch"), "cuda": versions.get("cuda"), "nccl": versions.get("nccl"),
                  "python": versions.get("python"),
                  "source": f"versions recorded in {run_origin} by the measured run"},
        "workload": {"row_tokens": row_tokens, "rows": ROWS_TEXT[card_workflow(recipe, manifest)],
                     "global_batch": recipe.global_batch, "precision": recipe.card_precision(),
                     "workflow": card_workflow(recipe, manifest),
                     "modality": "image-text" if manifest.get("images") else "text",
                     "dataset": dataset_block(manifest, str(versions.get("openrecipes", "?")))},
        "layout": layout_block(recipe, row_tokens, int(run.require("model.num_layers", run_origin))),
        "result": result,
        "correctness": _correctness(rules, convergence_block(conv_report, run_dir, ref_dir), conv_report, tests,
                                    reference_text),
        "env": {},
        "patches": [],
        "run": options.run_command or str(run.require("command", run_origin)),
        "notes": notes_text,
        "recipe": dump_recipe(options.recipe if options.recipe is not None else recipe),
        "curves": {"candidate": curve_points(candidate_curve, run_dir, measured.gpus),
                   "reference": curve_points(reference_curve),
                   "memory_phases_gib": memory_phases(run_dir, measured.window)},
        **({"tuning": options.tuning} if options.tuning is not None else {}),
    }


def _notes_text(options: NewCardOptions, run_dir: Path, started: str, measured: Any) -> str:
    """The card's notes: the options' first, then where and over which window it was measured, the price's source
    and measure's own notes (the resolved recipe is the card's own field)."""
    notes = [*options.notes, f"Measured by openrecipes from run directory {run_dir} (started {started}); measurement "
             f"window steps {shown_step(measured.window[0])}-{shown_step(measured.window[1])} (counted from 1)."]
    if measured.price_source:
        notes.append(f"Price: {measured.usd_per_gpu_hour} USD per GPU-hour from {measured.price_source}.")
    notes += [f"measure: {note}" for note in measured.notes]
    return "".join(f"- {note}\n" for note in notes)


def _gpu_block(options: NewCardOptions, run: Any, measured: Any) -> dict[str, Any]:
    """The card's ``gpu``: the hardware table's spelling and memory where it knows the type, else the options'."""
    from openrecipes.config.hardware import load_hardware

    try:  # the table's spelling (H200, not h200) when the type is known
        spec = load_hardware().gpu(measured.gpu_type)
        gpu_type, memory_as_sold = spec.name, spec.memory_gb
    except ValueError:
        gpu_type, memory_as_sold = measured.gpu_type, None
    memory = options.gpu_memory_gb or memory_as_sold or _cpu_run_memory_gb(run, measured.gpu_type)
    if memory is None:
        raise ValueError(f"--gpu-memory-gb: the memory of one {gpu_type!r} device is not known; give it")
    per_node = options.gpus_per_node
    if per_node is None:
        if measured.gpus > 8:
            raise ValueError(f"--gpus-per-node: the run used {measured.gpus} devices; say how many per node")
        per_node = measured.gpus
    return {"type": gpu_type, "memory_gb": float(memory), "count": measured.gpus, "per_node": per_node,
            "instance": options.instance}


def _result_block(measured: Any, gpu_type: str, samples: tuple[float, ...] = ()) -> dict[str, Any]:
    """The card's ``result`` as `openrecipes measure` computed it; with ``samples`` (the run's measurement first),
    their median and what follows from it (MFU, price per token), over ``runs`` = their count."""
    from openrecipes.config.hardware import usd_per_million_tokens
    from openrecipes.measure.metrics import mfu

    if samples and abs(samples[0] - measured.tokens_per_s_per_gpu) > 1e-9 * measured.tokens_per_s_per_gpu:
        raise ValueError(f"samples: the first, {samples[0]}, is not the run's own measurement "
                         f"{measured.tokens_per_s_per_gpu}")
    tps = statistics.median(samples) if samples else measured.tokens_per_s_per_gpu
    return {
        "tokens_per_s_per_gpu": tps,
        "usd_per_million_tokens": (usd_per_million_tokens(measured.usd_per_gpu_hour, tps)
                                   if measured.usd_per_gpu_hour is not None else None),
        "usd_per_gpu_hour": measured.usd_per_gpu_hour,
        "step_time_cv_percent": measured.step_time_cv * 100.0,
        "mfu": (mfu(measured.active_params, tps, measured.peak_flops_per_gpu)
                if measured.mfu is not None else None),
        "mfu_note": None if measured.mfu is not None else (
            f"no peak FLOP/s for {gpu_type!r} in the hardware table (a CPU has none): MFU not computed"),
        "window": list(measured.window),
        "window_tokens": measured.window_tokens,
        "runs": max(1, len(samples)),
        "gpu_hours": measured.gpu_hours,
        "gpu_hours_note": measured.gpu_hours_note,
    }


def new_card(options: NewCardOptions) -> tuple[Path, list[Any]]:
    """Build the card, write it atomically to ``options.out`` and validate the written file.

    Returns the path and the validator's problems (errors, warnings and notes). A ``verified`` status is refused
    before anything is written unless every check, the verified ones included, passes (for a card of a repository's
    recipes/ catalog, the absolute-path check too). Absolute paths under the working directory are written relative.
    """
    import pydantic

    from openrecipes.cards.checks import check_card
    from openrecipes.cards.paths import is_catalog_path, named_by_file, relative_to
    from openrecipes.cards.schema import RecipeCard
    from openrecipes.cards.validate import format_loc, path_findings, validate_file
    from openrecipes.utils import atomic_write_text, check_output_file

    out = Path(options.out)
    # the card never replaces what it is made from (a run's metrics, a component-test file)
    check_output_file(out, (options.run_dir, options.reference, *options.component_tests), option="--out")
    if out.exists() and not options.overwrite:
        raise FileExistsError(f"--out {out} exists; pass --overwrite to replace it")
    # paths under the working directory as a clone of it names them; others stay absolute (card validate flags them)
    data = relative_to(build_card_data(options), Path.cwd())
    if options.output_dir is not None:
        data = named_by_file(relative_to(data, options.output_dir))
    try:
        card = RecipeCard.model_validate(data)
    except pydantic.ValidationError as error:
        first = error.errors(include_url=False)[0]
        raise ValueError(f"the card built from {options.run_dir} does not fit the schema: "
                         f"{format_loc(first['loc'])}: {first['msg']}") from None
    if options.status == "verified":
        blocking = [f for f in check_card(card) if f.severity == "error"]
        publishable = is_catalog_path(out) or options.output_dir is not None
        blocking += path_findings(data, published=True) if publishable else []
        if blocking:
            raise ValueError("--status verified refused: " + "; ".join(
                f"{format_loc(f.loc)}: {f.message}" for f in blocking))
    header = (f"# {out.name}: measured by openrecipes; written by `openrecipes card new`.\n"
              "# The fields are documented in schema/recipe.schema.json.\n")
    atomic_write_text(out, dump_card(data, header))
    _, problems = validate_file(out)
    return out, problems
