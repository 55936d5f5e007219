"""The `openrecipes` command line: one entry point, thin verbs.

Each verb lives in the package that owns its logic, in a module exposing
``register(subparsers)``. That function adds the verb's parser and sets
``func`` (called with the parsed namespace, returning an exit status).
Heavy imports (torch, pyarrow) happen inside ``func``, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from openrecipes.utils import register_modules

# verb -> module that registers it; order is the order shown in --help
VERB_MODULES: dict[str, str] = {
    "demo": "openrecipes.demo",
    "models": "openrecipes.models.cli",
    "convert": "openrecipes.checkpoint.cli",
    "train": "openrecipes.train.cli",
    "launch": "openrecipes.train.launch",
    "plan": "openrecipes.plan.cli",
    "data": "openrecipes.data.cli",
    "measure": "openrecipes.measure.cli",
    "verify": "openrecipes.verify.cli",
    "card": "openrecipes.cards.cli",
    "site": "openrecipes.site.cli",
    "tune": "openrecipes.tune.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openrecipes",
        description="Turn a Mixture-of-Experts model and a GPU fleet into a tuned, verified, "
        "reproducible training recipe.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    register_modules(subparsers, VERB_MODULES.values())
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from openrecipes import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError) as error:
        # user errors: one clear line naming the field or file, no traceback
        print(f"openrecipes {args.verb}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
