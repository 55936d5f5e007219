"""`openrecipes card verify-item RUN_DIR --model M --workflow W [...]`: write one verification-card item."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from openrecipes.cards.verification import WORKFLOWS


def register_verify_item(verbs: argparse._SubParsersAction) -> None:
    item = verbs.add_parser(
        "verify-item", help="write or update one item of a model's verification card from a run",
        description="Write the item of verification/<MODEL>.yaml for --workflow and the run's hardware, precision "
        "and layout from RUN_DIR (a training run directory; for import and export, the converted checkpoint "
        "directory with --audit), replacing the item of the same combination and leaving the others as they are. "
        "Exit status: 0 written, 1 the item has validation errors (nothing written), 2 bad input.")
    item.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="training run directory, or converted checkpoint")
    item.add_argument("--model", required=True, metavar="M", help="card name: the file verification/M.yaml")
    item.add_argument("--workflow", required=True, choices=WORKFLOWS, help="the workflow the run exercised")
    item.add_argument("--cards", type=Path, default=Path("verification"), metavar="DIR",
                      help="directory of the verification cards")
    item.add_argument("--model-name", metavar="NAME", help="model name as published, for a new card")
    item.add_argument("--description", metavar="TEXT", help="what the model is, for a new card")
    item.add_argument("--status", choices=("unverified", "verified"), default="unverified",
                      help="verified is refused unless the item passes every check of `card validate`")
    item.add_argument("--command", metavar="TEXT", help="the exact command (default: run.json's command)")
    item.add_argument("--observed", metavar="TEXT", help="text added after the generated summary of the result")
    item.add_argument("--hardware", metavar="TYPE", help="GPU type instead of run.json's gpu.type (cpu for conversion)")
    item.add_argument("--precision", choices=("bf16", "fp16", "fp32", "fp8"),
                      help="default: the recipe's; needed for import and export")
    item.add_argument("--layout", metavar="LABEL", help="layout label (default: TPn PPn CPn EPn DPn of the recipe)")
    item.add_argument("--checkpoint-source", metavar="TEXT", help="where the checkpoint comes from")
    item.add_argument("--checkpoint-revision", metavar="REV", help="pinned revision of a published checkpoint")
    item.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                      help="a generated checkpoint, identified by its hash (default: what the run wrote)")
    item.add_argument("--reference", type=Path, metavar="RUN_DIR",
                      help="a run of the same rows on another layout (e.g. one process): adds the convergence check")
    item.add_argument("--audit", type=Path, metavar="FILE.json", help="`openrecipes convert audit --json` output")
    item.add_argument("--recorded", type=datetime.date.fromisoformat, metavar="YYYY-MM-DD",
                      help="date of the record (default: today)")
    item.set_defaults(func=_verify_item)


def _verify_item(args: argparse.Namespace) -> int:
    from openrecipes.cards.verify_item import ItemOptions, update_card

    options = ItemOptions(
        run_dir=args.run_dir, model=args.model, workflow=args.workflow, cards_dir=args.cards,
        model_name=args.model_name, description=args.description, status=args.status, command=args.command,
        observed=args.observed, hardware=args.hardware, precision=args.precision, layout=args.layout,
        checkpoint_source=args.checkpoint_source, checkpoint_revision=args.checkpoint_revision,
        checkpoint_dir=args.checkpoint_dir, audit=args.audit, reference=args.reference, recorded=args.recorded)
    path, index, errors = update_card(options)
    for problem in errors:
        print(problem, file=sys.stderr)
    if errors:
        print(f"{path}: item {index} not written: {len(errors)} validation error(s)", file=sys.stderr)
        return 1
    print(f"wrote item {index} ({args.workflow}) of {path}")
    return 0
