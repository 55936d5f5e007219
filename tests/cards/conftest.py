from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from .card_fixtures import MUSE_CARD, QWEN_CARD, read_card_data


@pytest.fixture
def qwen() -> dict[str, Any]:
    return copy.deepcopy(read_card_data(QWEN_CARD))


@pytest.fixture
def muse() -> dict[str, Any]:
    return copy.deepcopy(read_card_data(MUSE_CARD))


@pytest.fixture
def write_card(tmp_path: Path) -> Callable[..., Path]:
    def write(data: dict[str, Any], name: str = "card.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False, width=100))
        return path

    return write
