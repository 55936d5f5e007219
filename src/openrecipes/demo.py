"""`openrecipes demo`: the main job end to end on the embedded default, with no downloads.

Builds rows from the bundled conversations, trains the tiny Qwen3-MoE under a reference layout (one process) and a
different candidate layout (data + expert parallel over two processes), measures both, verifies the candidate
(convergence against the reference, numerics rules, the optimizer component test), writes and validates its recipe
card, records the candidate as an item of the model's verification card, and builds the site with its model page.
Uses GPUs when there are any and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

from openrecipes.utils import check_output_dir, mark_output_dir

MARKER = ".openrecipes-demo"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the main job end to end on the embedded default (no downloads)",
                                   description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("--out", default="demo-out", help="output directory (default: demo-out); a previous demo "
                                                          "output there is replaced")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20; at least 6)")
    parser.set_defaults(func=run)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _call(argv: list[str], *, capture: bool = False) -> tuple[int, str]:
    """Run one `openrecipes` verb in this process; optionally capture what it prints."""
    from openrecipes.cli import main

    if not capture:
        return main(argv), ""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = main(argv)
    return status, buffer.getvalue()


def _prepare_out(path: Path) -> Path:
    # only a previous demo output (it carries MARKER) is replaced; never the current directory
    check_output_dir(path, marker=MARKER, writer="openrecipes demo", overwrite=True)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    mark_output_dir(path, marker=MARKER, writer="openrecipes demo")  # empty until the demo finishes and lists
    return path


def _recipe_tree(*, name: str, rows: Path, run_dir: Path, steps: int, precision: str, dp: int, ep: int,
                 recompute: str) -> dict:
    return {
        "name": name, "model": "qwen3-moe-tiny", "data": {"rows": str(rows)},
        "layout": {"dp": dp, "ep": ep, "max_tokens_per_gpu": 512},
        "recompute": {"granularity": recompute},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "betas": [0.9, 0.98], "weight_decay": 0.1, "warmup_fraction": 0.1,
                      "grad_clip": 1.0},
        "precision": precision, "steps": steps, "global_batch": 8, "seed": 0, "run_dir": str(run_dir),
        "checkpoint": {"every": None},
    }


def run(args: argparse.Namespace) -> int:
    if args.steps < 6:
        raise ValueError(f"--steps must be at least 6 (the measurement window starts at step 5), got {args.steps}")
    started = time.perf_counter()
    out = _prepare_out(Path(args.out))
    try:
        return _run_in(out, args, started)
    finally:  # what the demo wrote, finished or stopped, is all a later demo may replace
        mark_output_dir(out, marker=MARKER, writer="openrecipes demo")


def _run_in(out: Path, args: argparse.Namespace, started: float) -> int:
    import torch

    from openrecipes.config.recipe import dump_recipe, recipe_from_dict

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = 2 if gpus == 0 or gpus >= 2 else 1
    precision = "bf16" if gpus else "fp32"
    where = (f"{gpus} GPU(s) ({torch.cuda.get_device_name(0)})" if gpus
             else "the CPU (no GPU found; two gloo processes for the parallel layout)")
    _say(f"openrecipes demo on {where}; writing {out}")

    _say("[1/7] building fixed rows from the bundled conversations")
    rows = out / "rows"
    _check(_call(["data", "build", "--loss-mask", "qwen3", "--row-tokens", "256", "--rows", "96", "--seed", "42",
                  "--no-progress", "--out", str(rows)], capture=True)[0], "data build")

    runs, recipes = out / "runs", out / "recipe-files"
    recipes.mkdir()
    reference = _recipe_tree(name="demo-reference", rows=rows, run_dir=runs / "reference", steps=args.steps,
                             precision=precision, dp=1, ep=1, recompute="none")
    candidate = _recipe_tree(name="demo-candidate", rows=rows, run_dir=runs / "candidate", steps=args.steps,
                             precision=precision, dp=nproc, ep=nproc, recompute="full")
    for tree in (reference, candidate):
        (recipes / f"{tree['name']}.yaml").write_text(dump_recipe(recipe_from_dict(tree)))

    _say(f"[2/7] training the reference: one process, no recompute, {args.steps} steps")
    _check(_call(["train", str(recipes / "demo-reference.yaml")])[0], "reference training")
    layout = f"DP{nproc} EP{nproc}, full recompute" if nproc > 1 else "one GPU, full recompute"
    _say(f"[3/7] training the candidate: {layout}, {nproc} process(es)")
    _check(_call(["train", str(recipes / "demo-candidate.yaml"), "--nproc", str(nproc)])[0], "candidate training")

    verify_dir, window = out / "verify", ["--window", "5", str(args.steps - 1)]
    measured, checks = _measure_and_verify(runs, recipes, verify_dir, window, args.steps)
    shows = what_it_shows(measured, nproc=nproc, gpus=gpus)
    card, card_checks = _card_and_site(out, runs, recipes, verify_dir, window, measured, shows, nproc=nproc,
                                       gpus=gpus)
    checks.update(card_checks)
    summary = _summary(where, args.steps, round(time.perf_counter() - started, 1), measured, runs, checks, shows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(summary, out, card)
    return 0 if all(status == 0 for status in checks.values()) else 1


def _measure_and_verify(runs: Path, recipes: Path, verify_dir: Path, window: list[str],
                        steps: int) -> tuple[dict[str, dict], dict[str, int]]:
    """Steps 4 and 5: both runs measured, the candidate verified; the measurements and each check's exit status."""
    _say(f"[4/7] measuring both runs (window steps 6-{steps} of {steps})")
    verify_dir.mkdir()
    measured = {}
    for name in ("reference", "candidate"):
        status, text = _call(["measure", str(runs / name), *window, "--json"], capture=True)
        _check(status, f"measure {name}")
        measured[name] = json.loads(text)
        (verify_dir / f"measure-{name}.json").write_text(text)

    _say("[5/7] verifying the candidate: convergence, numerics rules, optimizer component test")
    conv_status, conv_text = _call(["verify", "convergence", str(runs / "candidate"), str(runs / "reference"),
                                    "--json", "--plot", str(verify_dir / "convergence.svg")], capture=True)
    (verify_dir / "convergence.json").write_text(conv_text)
    rules_status, rules_text = _call(["verify", "rules", str(recipes / "demo-candidate.yaml"),
                                      str(recipes / "demo-reference.yaml"), "--json"], capture=True)
    (verify_dir / "rules.json").write_text(rules_text)
    optimizer_status, optimizer_text = _call(["verify", "optimizer", "--json"], capture=True)
    (verify_dir / "optimizer.json").write_text(optimizer_text)
    return measured, {"convergence": conv_status, "numerics rules": rules_status,
                      "optimizer component test": optimizer_status}


def _card_and_site(out: Path, runs: Path, recipes: Path, verify_dir: Path, window: list[str],
                   measured: dict[str, dict], shows: str, *, nproc: int, gpus: int) -> tuple[Path, dict[str, int]]:
    """Steps 6 and 7: the candidate's card, its verification item and the site; the card and each exit status."""
    _say("[6/7] writing and validating the candidate's recipe card")
    gpu_dir = "cpu" if not gpus else measured["candidate"]["gpu_type"].lower()
    card = out / "recipes" / "qwen3-moe-tiny" / gpu_dir / "demo-candidate.yaml"
    card_status = _call(["card", "new", str(runs / "candidate"), "--reference", str(runs / "reference"),
                         "--component-test", str(verify_dir / "optimizer.json"), "--author", "openrecipes demo",
                         *window, "--note", shows, "--out", str(card)])[0]  # a CPU run's card states its host's memory
    if card_status == 0:
        card_status = _call(["card", "validate", str(card)])[0]

    _say("[7/7] recording the candidate as a verification item; building the site with its model page")
    verification = out / "verification"
    item_status = _call(["card", "verify-item", str(runs / "candidate"), "--model", "qwen3-moe-tiny", "--workflow",
                         "sft", "--cards", str(verification), "--model-name", "Qwen3-MoE tiny",
                         "--reference", str(runs / "reference"), "--command",
                         f"openrecipes train {recipes / 'demo-candidate.yaml'} --nproc {nproc}"])[0]
    # the demo's card beside the published ones, when this checkout has the catalog
    from openrecipes.site.build import published_catalog

    catalog = published_catalog()
    extra = ["--recipes", str(catalog)] if catalog is not None else []
    site_status = _call(["site", "build", "--recipes", str(out / "recipes"), *extra, "--verification",
                         str(verification), "--out", str(out / "site")])[0]

    return card, {"recipe card": card_status, "verification item": item_status, "site": site_status}


def _summary(where: str, steps: int, seconds: float, measured: dict[str, dict], runs: Path, checks: dict[str, int],
             shows: str) -> dict:
    """summary.json: both runs' numbers and final losses, each check's verdict, and what the demo shows."""
    return {"device": where, "steps": steps, "seconds": seconds,
            "runs": {name: {k: measured[name].get(k) for k in ("tokens_per_s_per_gpu", "step_time_cv", "gpus")}
                     for name in measured},
            "final_loss": {name: _last_loss(runs / name) for name in ("reference", "candidate")},
            "checks": {name: "pass" if status == 0 else "FAIL" for name, status in checks.items()},
            "what_it_shows": shows}


def what_it_shows(measured: dict[str, dict], *, nproc: int, gpus: int) -> str:
    """The sentence the card and the summary carry: the demo verifies a change of layout; whether that layout is
    faster here is measured, not claimed."""
    reference, candidate = (measured[name]["tokens_per_s_per_gpu"] for name in ("reference", "candidate"))
    layout = f"DP{nproc} EP{nproc} with full recompute" if nproc > 1 else "full recompute"
    where = "on this CPU (gloo processes sharing its cores)" if not gpus else f"on {gpus} GPU(s)"
    ratio = candidate / reference
    verdict = ("faster" if ratio > 1 else "slower") + f" ({ratio:.2f}x the reference's tokens/s per process)"
    return (f"What the demo shows: a change of layout checked against the reference ({layout} against one process "
            f"without recompute: convergence, numerics rules, optimizer), not a faster recipe; {where} the candidate "
            f"measured "
            f"{verdict}. `openrecipes tune` searches for a faster one.")


class DemoStageFailed(ValueError):
    """A stage the rest depends on failed; its own messages were printed above."""


def _check(status: int, what: str) -> None:
    if status != 0:
        raise DemoStageFailed(f"{what} failed (exit status {status}); see the messages above")


def _last_loss(run_dir: Path) -> float:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["loss"]


def _print_summary(summary: dict, out: Path, card: Path) -> None:
    rows = [("run", "tokens/s/GPU", "step-time CV", "final loss")]
    for name, numbers in summary["runs"].items():
        rows.append((name, f"{numbers['tokens_per_s_per_gpu']:,.0f}", f"{100 * numbers['step_time_cv']:.2f} %",
                     f"{summary['final_loss'][name]:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print(f"\nopenrecipes demo: {summary['device']}, {summary['steps']} steps per run, {summary['seconds']} s")
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    print("\nchecks: " + ", ".join(f"{name} {result}" for name, result in summary["checks"].items()))
    print("\n" + summary["what_it_shows"])
    print(f"\nlook at:\n  {out / 'site' / 'index.html'}   the site (openrecipes site serve --dir {out / 'site'})\n"
          f"  {card}   the candidate's recipe card\n  {out / 'verify'}   measurements and verification reports\n"
          f"  {out / 'summary.json'}")
