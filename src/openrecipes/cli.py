"""The `openrecipes` command line: one entry point, thin verbs.

Each verb lives in the package that owns its logic, in a module exposing
``register(subparsers)``. That function adds the verb's parser and sets
``func`` (called with the parsed namespace, returning an exit status).
Heavy imports (torch, pyarrow) happen inside ``func``, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from openrecipes.utils import one_line, register_modules

# verb -> module that registers it; order is the order shown in --help
VERB_MODULES: dict[str, str] = {
    "demo": "openrecipes.demo",
    "models": "openrecipes.models.cli",
    "convert": "openrecipes.checkpoint.cli",
    "train": "openrecipes.train.cli",
    "launch": "openrecipes.train.slurm_cli",
    "plan": "openrecipes.plan.cli",
    "data": "openrecipes.data.cli",
    "measure": "openrecipes.measure.cli",
    "measure-rank": "openrecipes.train.rank_cli",
    "verify": "openrecipes.verify.cli",
    "card": "openrecipes.cards.cli",
    "site": "openrecipes.site.cli",
    "tune": "openrecipes.tune.cli",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag shows its default, unless its help already says it or there is none to show (None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, [], (), argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _finish(parser: argparse.ArgumentParser) -> None:
    """Give every verb (at every level) the formatter above, and its one-line help as its description when the
    module that registered it wrote none, so that `openrecipes VERB --help` always says what VERB does."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if not sub.description and helps.get(name):
                    sub.description = helps[name][0].upper() + helps[name][1:] + "."
                _finish(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openrecipes",
        description="Turn a Mixture-of-Experts model and a GPU fleet into a tuned, verified, "
        "reproducible training recipe.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    register_modules(subparsers, VERB_MODULES.values())
    _finish(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from openrecipes.version import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # here, so a closed pipe is met inside this try rather than at interpreter exit
        return status
    except BrokenPipeError:
        # the reader stopped reading (`openrecipes ... --json | head`): end quietly, as Unix tools do; stdout goes
        # to /dev/null so the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # what a process ended by SIGPIPE reports
    except (ValueError, OSError) as error:
        # user errors, a path the system refuses included (a link loop, a name too long): one clear line naming the
        # field or file, no traceback; a name's line breaks and terminal controls are escaped, so it can neither
        # add a line nor drive the terminal
        print(f"openrecipes {args.verb}: error: {one_line(error)}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        if not str(error).startswith("Symlink loop from "):  # pathlib's resolve() on a link loop (Python < 3.13)
            raise
        print(f"openrecipes {args.verb}: error: {one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
