"""Paths and small helpers shared by the card tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CATALOG = REPO / "recipes"
QWEN_CARD = CATALOG / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.yaml"
MUSE_CARD = CATALOG / "muse-spark-open" / "h200" / "attune-tp4-pp16-ep8.yaml"


def read_card_data(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def line_of(path: Path, needle: str) -> int:
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in {path}")
