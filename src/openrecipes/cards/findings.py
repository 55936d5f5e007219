"""What a card check returns: a finding at a field's path, and the rounding rule the checks compare numbers within."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Loc = tuple[str | int, ...]
HEX40 = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True, kw_only=True)
class Finding:
    loc: Loc
    message: str
    severity: Literal["error", "warning", "note"] = "error"


def half_unit(value: float) -> float:
    """Half a unit in the last decimal place the value is written with (0.0898 -> 5e-5)."""
    text = repr(float(value)).lower()
    mantissa, _, exponent = text.partition("e")
    decimals = len(mantissa.partition(".")[2].rstrip("0")) - (int(exponent) if exponent else 0)
    return 0.5 * 10.0 ** (-decimals)
