"""``verify rules``: compare two recipes field by field with the numerics classification of every recipe field
(``openrecipes.config.numerics``, its one home)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openrecipes.config.numerics import Difference, RulesReport
from openrecipes.config.numerics import compare_recipes as compare_numerics
from openrecipes.config.rundir import RECIPE_FILE


def _rows_identity(value: Any) -> Any:
    """A rows directory stands for its content: two copies of the same rows are the same data."""
    if not isinstance(value, str):
        return value
    from openrecipes.data.manifest import read_manifest

    try:
        digest = read_manifest(value, require=()).get("rows_sha256")
    except (OSError, ValueError):
        return value
    return f"rows_sha256:{digest}" if isinstance(digest, str) else value


def compare_recipes(candidate: Any, reference: Any, *, candidate_name: str = "candidate",
                    reference_name: str = "reference") -> RulesReport:
    """``config.numerics.compare_recipes`` with rows directories compared by their content."""
    return compare_numerics(candidate, reference, candidate_name=candidate_name, reference_name=reference_name,
                            rows_identity=_rows_identity)


def recipe_path(path: str | Path) -> Path:
    """A recipe file, or a run directory standing for its ``recipe.yaml``."""
    path = Path(path)
    if path.is_dir():
        path = path / RECIPE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such recipe file")
    return path


def check_rules(candidate: str | Path, reference: str | Path) -> RulesReport:
    """Load two recipes (files or run directories) and compare them."""
    from openrecipes.config.recipe import load_recipe

    cand_path, ref_path = recipe_path(candidate), recipe_path(reference)
    return compare_recipes(load_recipe(cand_path), load_recipe(ref_path),
                           candidate_name=str(cand_path), reference_name=str(ref_path))


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def format_report(report: RulesReport) -> str:
    lines = [f"numerics rules: {'PASS' if report.passed else 'FAIL'}",
             f"candidate: {report.candidate}", f"reference: {report.reference}", ""]
    for title, diffs in (("numerics-affecting differences", report.numerics),
                         ("performance-only differences (allowed)", report.performance)):
        lines.append(f"{title}: {len(diffs) or 'none'}")
        for d in diffs:
            lines.append(f"  {d.path}: {_value_text(d.candidate)} (candidate) vs "
                         f"{_value_text(d.reference)} (reference) -- {d.reason}")
    return "\n".join(lines)


def summary_text(report: RulesReport) -> str:
    """One sentence for a recipe card's correctness block."""
    def listed(diffs: list[Difference]) -> str:
        return ", ".join(f"{d.path} {_value_text(d.candidate)} vs {_value_text(d.reference)}" for d in diffs)

    head = ("no numerics-affecting difference" if report.passed
            else f"numerics-affecting differences: {listed(report.numerics)}")
    tail = (f"; performance-only differences: {listed(report.performance)}" if report.performance
            else "; no performance-only difference")
    return f"numerics rules of openrecipes.verify.rules: {head}{tail}"
