"""`openrecipes card validate PATH...`, `openrecipes card new RUN_DIR ...` and `openrecipes card schema`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openrecipes.cards.verify_item_cli import register_verify_item


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("card", help="write a card from a run, validate cards, export the card schema")
    verbs = parser.add_subparsers(dest="card_verb", metavar="ACTION", required=True)

    validate = verbs.add_parser("validate", help="check recipe and verification cards: schema, hostile YAML, derived "
                                                 "numbers")
    validate.add_argument("paths", nargs="+", metavar="PATH",
                          help="card files, or directories searched recursively for *.yaml (a file with "
                               "kind: verification is a verification card; *.recipe.yaml files are recipes, skipped)")
    validate.add_argument("--quiet", action="store_true", help="print errors and warnings only, no notes")
    validate.add_argument("--published", action="store_const", const=True, default=None,
                          help="check every recipe card as a catalog card: an absolute machine path is an error "
                               "(default: only for cards under a repository's recipes/, a warning elsewhere)")
    validate.set_defaults(func=_validate)

    _register_new(verbs)
    register_verify_item(verbs)

    schema = verbs.add_parser("schema", help="write the JSON Schema of a recipe or verification card")
    schema.add_argument("--kind", choices=("recipe", "verification"), default="recipe",
                        help="which card's schema (schema/recipe.schema.json, schema/verification.schema.json)")
    schema.add_argument("--out", type=Path, help="file to write (default: standard output)")
    schema.add_argument("--check", action="store_true",
                        help="exit 1 if --out differs from the generated schema instead of writing it")
    schema.set_defaults(func=_schema)


def _validate(args: argparse.Namespace) -> int:
    from openrecipes.cards.verification_load import validate_any

    files, problems = validate_any(args.paths, published=getattr(args, "published", None))
    errors = [p for p in problems if p.severity == "error"]
    warnings = [p for p in problems if p.severity == "warning"]
    for problem in problems:
        if problem.severity != "note" or not args.quiet:
            print(problem, file=sys.stderr if problem.severity == "error" else sys.stdout)
    bad = len({p.file for p in errors})
    print(f"{files} card(s) checked, {bad} with errors, {len(errors)} error(s)"
          + (f", {len(warnings)} warning(s)" if warnings else ""))
    return 1 if errors else 0


def _register_new(verbs: argparse._SubParsersAction) -> None:
    from openrecipes.config.hardware import add_gpu_option

    new = verbs.add_parser(
        "new", help="write a card from a measured run, its reference run and its verification results",
        description="Build a recipe card from RUN_DIR (recipe, run.json, measurement over the window, rows "
        "manifest), the convergence check and numerics rules against the --reference run, and optional "
        "component-test JSON; write it atomically to --out and validate it. Exit status: 0 a valid card, "
        "1 the written card has validation errors, 2 bad input.")
    new.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the measured (candidate) run")
    new.add_argument("--reference", type=Path, required=True, metavar="RUN_DIR",
                     help="the reference run the candidate's loss curve and recipe are checked against")
    new.add_argument("--out", type=Path, required=True, metavar="PATH",
                     help="card file to write, e.g. recipes/<model>/<gpu>/<name>.yaml")
    new.add_argument("--author", required=True, metavar="NAME", help="who measured the run (the card's author)")
    new.add_argument("--author-url", metavar="URL", help="a link for the author (http or https)")
    new.add_argument("--window", type=int, nargs=2, default=None, metavar=("FIRST", "LAST"),
                     help="measurement window, steps inclusive (default: 5 19, or 5 to the last step of a run "
                          "shorter than 20 steps)")
    add_gpu_option(new, aliases=("--gpu-type",), help="GPU type instead of run.json's gpu.type, e.g. H200")
    new.add_argument("--gpu-memory-gb", type=float, metavar="GB",
                     help="memory of one GPU (known for H100 and H200, and for a CPU run: its host's; needed for other "
                          "types)")
    new.add_argument("--gpus-per-node", type=int, metavar="N",
                     help="GPUs per node (default: the run's count when it is at most 8)")
    price = new.add_mutually_exclusive_group()
    price.add_argument("--instance", metavar="NAME", help="cloud instance whose price the hardware table holds")
    price.add_argument("--usd-per-gpu-hour", type=float, metavar="P", help="price of one GPU for one hour")
    new.add_argument("--status", choices=("unverified", "verified"), default="unverified",
                     help="verified is refused unless every check of `card validate` passes (default: unverified)")
    new.add_argument("--component-test", type=Path, action="append", default=[], metavar="FILE.json",
                     help="JSON of `openrecipes verify optimizer --json` (repeatable)")
    new.add_argument("--model-name", metavar="NAME", help="model name as published (default: the recipe's model)")
    new.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    new.add_argument("--note", action="append", default=[], metavar="TEXT",
                     help="a sentence written first in the card's notes (repeatable), e.g. what the run shows")
    new.set_defaults(func=_new)


def _new(args: argparse.Namespace) -> int:
    from openrecipes.cards.new import NewCardOptions, new_card
    from openrecipes.cards.schema_bounds import web_url

    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be positive, got {args.gpus_per_node}")
    try:  # its help promises an http(s) link; a javascript: or file: one is refused, not written into the card
        web_url(args.author_url)
    except ValueError as error:
        raise ValueError(f"--author-url: {error}") from None
    options = NewCardOptions(
        run_dir=args.run_dir, reference=args.reference, out=args.out, author=args.author,
        author_url=args.author_url, window=tuple(args.window) if args.window else None, gpu_type=args.gpu,
        gpu_memory_gb=args.gpu_memory_gb, gpus_per_node=args.gpus_per_node, instance=args.instance,
        usd_per_gpu_hour=args.usd_per_gpu_hour, status=args.status,
        component_tests=tuple(args.component_test), model_name=args.model_name, overwrite=args.overwrite,
        notes=tuple(args.note))
    out, problems = new_card(options)
    errors = [p for p in problems if p.severity == "error"]
    for problem in problems:
        print(problem, file=sys.stderr if problem.severity == "error" else sys.stdout)
    if errors:
        print(f"wrote {out}, but it has {len(errors)} validation error(s); fix them before adding it to the "
              "catalog", file=sys.stderr)
        return 1
    print(f"wrote {out} (valid card)")
    return 0


def _schema(args: argparse.Namespace) -> int:
    from openrecipes.cards.schema import card_json_schema_text
    from openrecipes.cards.verification import verification_json_schema_text
    from openrecipes.utils import atomic_write_text

    text = card_json_schema_text() if args.kind == "recipe" else verification_json_schema_text()
    if args.check:
        if args.out is None:
            raise ValueError("--check needs --out FILE")
        current = args.out.read_text() if args.out.exists() else None
        if current != text:
            print(f"{args.out} is stale; regenerate it with "
                  f"`openrecipes card schema --kind {args.kind} --out {args.out}`", file=sys.stderr)
            return 1
        return 0
    if args.out is None:
        sys.stdout.write(text)
    else:
        _check_schema_out(args.out, json.loads(text)["title"])
        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    return 0


def _check_schema_out(out: Path, title: str) -> None:
    """``--out`` is new, or an earlier schema of the same card (its title): a file of anything else, a recipe
    included, is not replaced."""
    from openrecipes.utils import check_output_file

    check_output_file(out, [])
    if not out.exists():
        return
    try:
        earlier = json.loads(out.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        earlier = None
    if not isinstance(earlier, dict) or earlier.get("title") != title:
        raise FileExistsError(f"--out: {out} exists and is not a JSON Schema of the {title}; choose another file "
                              "or remove it yourself")
