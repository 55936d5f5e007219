from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.sft_data_helpers import run_build


@pytest.fixture(scope="session")
def tiny_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rows") / "tiny"
    run_build(out, row_tokens=256, chunk_conversations=64)
    return out
