"""`openrecipes card validate PATH...` and `openrecipes card schema`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("card", help="validate recipe cards, export the card schema")
    verbs = parser.add_subparsers(dest="card_verb", metavar="ACTION", required=True)

    validate = verbs.add_parser("validate", help="check cards: schema, hostile YAML, derived numbers")
    validate.add_argument("paths", nargs="+", metavar="PATH",
                          help="card files, or directories searched recursively for *.yaml")
    validate.add_argument("--quiet", action="store_true", help="print errors only, no notes")
    validate.set_defaults(func=_validate)

    schema = verbs.add_parser("schema", help="write the JSON Schema of a card")
    schema.add_argument("--out", type=Path, help="file to write (default: standard output)")
    schema.add_argument("--check", action="store_true",
                        help="exit 1 if --out differs from the generated schema instead of writing it")
    schema.set_defaults(func=_schema)


def _validate(args: argparse.Namespace) -> int:
    from openrecipes.cards.validate import validate_paths

    cards, problems = validate_paths(args.paths)
    errors = [p for p in problems if p.severity == "error"]
    for problem in problems:
        if problem.severity == "error" or not args.quiet:
            print(problem, file=sys.stderr if problem.severity == "error" else sys.stdout)
    files = len({p.file for p in problems} | {str(c.path) for c in cards})
    bad = len({p.file for p in errors})
    print(f"{files} card(s) checked, {bad} with errors, {len(errors)} error(s)")
    return 1 if errors else 0


def _schema(args: argparse.Namespace) -> int:
    from openrecipes.cards.schema import card_json_schema_text
    from openrecipes.utils import atomic_write_text

    text = card_json_schema_text()
    if args.check:
        if args.out is None:
            raise ValueError("--check needs --out FILE")
        current = args.out.read_text() if args.out.exists() else None
        if current != text:
            print(f"{args.out} is stale; regenerate it with `openrecipes card schema --out {args.out}`",
                  file=sys.stderr)
            return 1
        return 0
    if args.out is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    return 0
