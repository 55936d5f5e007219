"""Numeric command-line options checked when they are parsed: finite and in range, or one line naming the option
(argparse's ``error: argument --minutes: ...``), before any work starts. NaN compares false with every bound, so a
``--minutes nan`` that is not refused here would disable whatever limit it sets."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def at_least(kind: type, minimum: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: ``kind(text)``, finite and >= ``minimum`` (> with ``above``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            what = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"{text} is not {what} {'>' if above else '>='} {minimum:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def positive(kind: type) -> Callable[[str], float]:
    """Finite and > 0 (an int: >= 1)."""
    return at_least(kind, 1) if kind is int else at_least(kind, 0, above=True)
