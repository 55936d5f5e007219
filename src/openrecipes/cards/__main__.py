"""`python -m openrecipes.cards ...`: the `card` verb without the rest of the command line."""

import argparse
import sys

from openrecipes.cards.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openrecipes.cards")
    register(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(["card", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"openrecipes card: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
