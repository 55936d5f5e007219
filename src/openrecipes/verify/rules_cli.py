"""``openrecipes verify rules CANDIDATE_RECIPE REFERENCE_RECIPE``."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(checks: Any) -> None:
    parser = checks.add_parser(
        "rules",
        help="list the numerics-affecting differences between two recipes",
        description="Compare two recipes field by field. Every recipe field is classified as "
        "numerics-affecting or performance-only (openrecipes.config.numerics.FIELD_RULES); any "
        "numerics-affecting difference fails, performance-only differences are listed for information. "
        "Each side is a recipe YAML file or a run directory (its recipe.yaml). "
        "Exit status: 0 pass, 1 a numerics-affecting difference, 2 bad input.",
    )
    parser.add_argument("candidate", metavar="CANDIDATE_RECIPE", help="recipe file or run directory")
    parser.add_argument("reference", metavar="REFERENCE_RECIPE", help="recipe file or run directory")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openrecipes.verify.rules import check_rules, format_report

    report = check_rules(args.candidate, args.reference)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    return 0 if report.passed else 1
