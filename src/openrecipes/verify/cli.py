"""``openrecipes verify CHECK ...``: one verb, one subcommand per check.

A check lives in its own module exposing ``register(subparsers)``, which adds the check's
parser to the ``verify`` subparsers and sets ``func`` (namespace -> exit status: 0 pass,
1 a check failed; input errors raise ValueError / FileNotFoundError, exit status 2).
Adding a check is one line in ``CHECK_MODULES``.
"""

from __future__ import annotations

import argparse
from typing import Any

EXIT_STATUS = "Exit status: 0 pass, 1 a check failed, 2 bad input."

# subcommand -> module that registers it; order is the order shown in --help
CHECK_MODULES: dict[str, str] = {
    "convergence": "openrecipes.verify.convergence_cli",
    "optimizer": "openrecipes.verify.optimizer_cli",
    "parity": "openrecipes.verify.parity_cli",
    "rules": "openrecipes.verify.rules_cli",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check a run, recipe or component against its reference",
        description=f"Verification checks. {EXIT_STATUS}",
    )
    from openrecipes.utils import register_modules

    checks = parser.add_subparsers(dest="check", metavar="CHECK")
    register_modules(checks, CHECK_MODULES.values())

    def no_check(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=no_check)
