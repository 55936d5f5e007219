"""``openrecipes verify convergence CANDIDATE REFERENCE``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from openrecipes.verify.cli import EXIT_STATUS

_DEFAULTS = {
    "correlation": 0.95,
    "high_loss_tolerance": 0.10,
    "medium_loss_tolerance": 0.05,
    "low_loss_tolerance": 0.02,
    "final_loss_tolerance": 0.05,
    "max_outlier_ratio": 0.1,
    "outlier_sigma": 3.0,
    "skip_first_fraction": 0.2,
}

_HELP = {
    "correlation": "minimum Pearson correlation",
    "high_loss_tolerance": "pointwise relative tolerance where the reference loss > 2.0",
    "medium_loss_tolerance": "pointwise relative tolerance where the reference loss > 0.5",
    "low_loss_tolerance": "pointwise relative tolerance elsewhere",
    "final_loss_tolerance": "maximum relative difference of the final loss",
    "max_outlier_ratio": "maximum share of pointwise failures, and of 3-sigma outliers",
    "outlier_sigma": "outlier distance from the mean difference, in standard deviations",
    "skip_first_fraction": "share of the first steps left out of correlation, pointwise and outlier checks",
}


def register(checks: Any) -> None:
    parser = checks.add_parser(
        "convergence",
        help="compare a candidate loss curve with a reference one",
        description="Compare two loss curves (Megatron-Bridge validate_convergence checks; NaN, "
        "infinite and missing steps fail). Each side is a run directory or a loss file: JSON Lines "
        'of {"step": int, "loss": float} or CSV with a step,loss header. ' + EXIT_STATUS,
    )
    parser.add_argument("candidate", metavar="CANDIDATE", help="run directory or loss file")
    parser.add_argument("reference", metavar="REFERENCE", help="run directory or loss file")
    for name, default in _DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=default,
                            metavar="X", help=f"{_HELP[name]} (default: {default})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.svg", help="write an SVG of both curves")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openrecipes.verify.convergence import Thresholds, check_convergence, format_report
    from openrecipes.verify.curves import read_loss_curve

    if args.plot is not None and not str(args.plot).lower().endswith(".svg"):
        raise ValueError(f"--plot {args.plot}: only SVG output is supported (name it FILE.svg)")
    thresholds = Thresholds(**{name: getattr(args, name) for name in _DEFAULTS})
    candidate = read_loss_curve(args.candidate)
    reference = read_loss_curve(args.reference)
    report = check_convergence(candidate, reference, thresholds)
    if args.plot is not None:
        from openrecipes.verify.plot import write_svg

        write_svg(args.plot, candidate, reference, title="loss: candidate vs reference",
                  skipped_steps=report.skipped_steps)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, allow_nan=False, default=str))
    else:
        print(format_report(report))
        if args.plot is not None:
            print(f"\nplot: {args.plot}")
    return 0 if report.passed else 1
