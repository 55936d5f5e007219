"""Verify the tuned recipe against the starting point before it is published.

Checks, each written to ``OUT/verify/<trial>/``: the numerics rules (every changed field performance-only,
``compare_recipes``), the convergence check of ``verify convergence`` (Megatron-Bridge thresholds) between the
candidate's trial run and the start's, which trained the same rows from the same initial weights (same seed and
model) for the same steps, and the optimizer component test (``verify optimizer``) when the optimizer's placement
changed (``offload.*``; its precision is a numerics field and never changes). The fastest measured candidate is
tried first; when it fails, the next fastest, and so on; every failure is kept for the card's notes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openrecipes.tune.search import SearchResult
from openrecipes.utils import atomic_write_text
from openrecipes.verify.convergence import Thresholds, check_convergence
from openrecipes.verify.curves import read_loss_curve
from openrecipes.verify.rules import compare_recipes, format_report

VERIFY_DIR = "verify"
OPTIMIZER_FILE = "optimizer.json"


@dataclass(kw_only=True)
class Verdict:
    record: dict[str, Any]
    passed: bool
    failures: list[str] = field(default_factory=list)
    optimizer_report: Path | None = None
    reports: Path | None = None


def optimizer_placement_changed(changes: dict[str, Any]) -> bool:
    return any(path.startswith("offload.") for path in changes)


# The component test inside a tuning budget: on a GPU the layer of verify/optimizer.py's CUDA shape with 8 of its 64
# experts (2 per token), the same widths and every arm; the full shape took 210 s on one H200, most of it moving
# fp64 copies of 805 M expert weights (BENCHMARKS.md), which is the budget of several trials.
TUNER_COMPONENT_TEST = {"cpu": [], "cuda": ["--experts", "8", "--top-k", "2"]}


def run_optimizer_test(out: Path, device: str) -> tuple[bool, Path]:
    """``openrecipes verify optimizer --json`` once per tuning output; its JSON feeds the card."""
    path = out / VERIFY_DIR / OPTIMIZER_FILE
    if not path.is_file():
        result = subprocess.run([sys.executable, "-m", "openrecipes", "verify", "optimizer", "--json",
                                 "--device", device, *TUNER_COMPONENT_TEST[device]],
                                capture_output=True, text=True, env=dict(os.environ))
        if result.returncode not in (0, 1) or not result.stdout.strip():
            raise ValueError(f"verify optimizer did not run (exit status {result.returncode}): "
                             f"{result.stderr.strip()[-500:]}")
        atomic_write_text(path, result.stdout)
    return bool(json.loads(path.read_text()).get("passed")), path


def verify_record(result: SearchResult, record: dict[str, Any], start_record: dict[str, Any],
                  device: str) -> Verdict:
    out = result.options.out
    candidate = result.candidates[record["key"]]
    reports = out / VERIFY_DIR / Path(record["run_dir"]).parent.name
    failures = []
    rules = compare_recipes(candidate.recipe, result.start, candidate_name=f"trial {record['index']}",
                            reference_name=str(result.start_path))
    atomic_write_text(reports / "rules.json", json.dumps(rules.to_dict(), indent=2, default=str) + "\n")
    atomic_write_text(reports / "rules.txt", format_report(rules) + "\n")
    if not rules.passed:
        failures.append("numerics rules: " + ", ".join(d.path for d in rules.numerics) + " differ")
    conv = check_convergence(read_loss_curve(out / record["run_dir"]), read_loss_curve(out / start_record["run_dir"]),
                             Thresholds())
    atomic_write_text(reports / "convergence.json", json.dumps(conv.to_dict(), indent=2) + "\n")
    if not conv.passed:
        failures.append("convergence: " + ", ".join(f"{c.name} ({c.detail or c.value})"
                                                    for c in conv.checks if not c.passed))
    optimizer_path = None
    if optimizer_placement_changed(candidate.changes):
        passed, optimizer_path = run_optimizer_test(out, device)
        if not passed:
            failures.append(f"optimizer component test failed ({optimizer_path})")
    return Verdict(record=record, passed=not failures, failures=failures, optimizer_report=optimizer_path,
                   reports=reports)


def choose_winner(result: SearchResult) -> tuple[Verdict | None, list[Verdict]]:
    """The fastest measured candidate that beats the start and passes every check, and the verdicts of those
    that were checked before it (faster, but failed)."""
    start = next(r for r in result.records if r["key"] == result.reference_key)  # the start as measured
    start_tps = start["measured"]["tokens_per_s_per_gpu"]
    faster = sorted((r for r in result.records if r["status"] == "ok" and r["key"] != result.reference_key
                     and r["measured"]["tokens_per_s_per_gpu"] > start_tps),
                    key=lambda r: -r["measured"]["tokens_per_s_per_gpu"])
    device = "cpu" if result.target.is_cpu else "cuda"
    failed = []
    last_step = result.options.measurement_window()[1]
    for record in faster:
        if record["measured"]["window"][1] < last_step:  # ended early (trial.early_end_s): not all its steps
            failed.append(Verdict(record=record, passed=False, failures=[
                f"its run ended at step {record['measured']['window'][1]}, once stable and slower than a trial "
                "measured before it: too short for the convergence check"]))
            continue
        verdict = verify_record(result, record, start, device)
        if verdict.passed:
            return verdict, failed
        failed.append(verdict)
    return None, failed
