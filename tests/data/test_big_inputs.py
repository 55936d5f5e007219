"""Big inputs: bounded memory, long conversations in windows, the per-conversation token limit."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from openrecipes.data import manifest as manifest_module
from openrecipes.data import stream
from openrecipes.data.build import _prepare
from openrecipes.data.packed import BuildJob
from openrecipes.data.sources import normalize
from openrecipes.data.templates import token_mask

from tests.data.sft_data_helpers import BUNDLED_CONVERSATIONS, build_job, read_rows, run_build, write_jsonl

# the rows of the bundled conversations (tests/data/conftest.py's build) before the builder streamed its work
BUNDLED_ROWS_SHA256 = "a247cc1b0b447dec74e9d20701b25327353b5f2596aa2ea00fd552088edd6dab"  # qwen3 template of Qwen3's own text
T = 64


def _long_conversation(chars: int, seed: int) -> dict:
    """Several turns of plain words (assistant-heavy, so every row holds a target) and ``chars`` characters."""
    rng = np.random.default_rng(seed)
    words = np.array("the model reads rows of tokens and learns from each target in turn".split())
    messages = []
    for turn in range(4):
        text = " ".join(words[rng.integers(words.size, size=chars // 20)])
        messages += [{"role": "user", "content": f"part {turn}"}, {"role": "assistant", "content": text}]
    return {"messages": messages}


def _expected_rows(config: BuildJob, limit: int | None, too_long: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The rows by the plain definition: each conversation encoded whole, limited, followed by the separator."""
    bundle, renderer, eos_id, _, _ = _prepare(config)
    records = [json.loads(line) for line in config.input.read_text().splitlines()]
    ids, mask, over = [], [], 0
    for index in np.random.default_rng(config.spec.seed).permutation(len(records)).tolist():
        text, spans = renderer.supervised_spans(*normalize(records[index], "", None))
        encoding = bundle.tokenizer.encode(text, add_special_tokens=False)
        conv_ids, conv_mask = list(encoding.ids), token_mask(np.asarray(encoding.offsets), spans).tolist()
        if limit is not None and len(conv_ids) > limit:
            over += 1
            if too_long == "skip":
                continue
            conv_ids, conv_mask = conv_ids[:limit], conv_mask[:limit]
        ids += conv_ids + [eos_id]
        mask += conv_mask + [0]
    n = len(ids) // T
    ids_RT, mask_RT = np.array(ids[:n * T]).reshape(n, T), np.array(mask[:n * T]).reshape(n, T)
    mask_RT[:, 0] = 0
    keep = mask_RT.any(axis=1)  # rows without a target are skipped
    return ids_RT[keep], mask_RT[keep], over


@pytest.mark.parametrize("limit, too_long", [(None, "skip"), (300, "skip"), (300, "truncate")])
def test_windows_and_token_limit_match_the_plain_definition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            limit: int | None, too_long: str) -> None:
    # tiny windows, so the long conversations are stitched from many windows (special tokens among the cuts)
    monkeypatch.setattr(stream, "WINDOW_CHARS", 2048)
    monkeypatch.setattr(stream, "MARGIN_CHARS", 128)
    bundled = BUNDLED_CONVERSATIONS.read_text().splitlines()[:30]
    records = [json.loads(line) for line in bundled] + [_long_conversation(12_000, 1), _long_conversation(900, 2)]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    options = dict(input=source, row_tokens=T, max_conversation_tokens=limit, too_long=too_long)
    manifest = run_build(tmp_path / "out", **options)
    rows = read_rows(tmp_path / "out")
    config = build_job(tmp_path / "x", tokenizer=Path(manifest["tokenizer"]["directory"]), loss_mask="qwen3",
                       **options)
    ids_RT, mask_RT, over = _expected_rows(config, limit, too_long)
    assert ids_RT.shape == rows["input_ids"].shape
    np.testing.assert_array_equal(rows["input_ids"], ids_RT)
    np.testing.assert_array_equal(rows["loss_mask"], mask_RT)
    if limit is None:
        assert manifest["conversation_token_limit"] is None
        assert "conversations_over_token_limit" not in manifest["counts"]
    else:
        assert over >= 2 and manifest["counts"]["conversations_over_token_limit"] == over  # the long one and others
        assert manifest["conversation_token_limit"] == {"max_tokens": limit, "too_long": too_long}
        assert manifest["counts"]["conversations_used"] == (32 - over if too_long == "skip" else 32)


def test_bundled_rows_unchanged(tiny_rows: Path) -> None:
    manifest = json.loads((tiny_rows / "manifest.json").read_text())
    assert manifest["rows_sha256"] == BUNDLED_ROWS_SHA256


def test_memory_is_bounded_by_a_window_not_the_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak Python memory: the same for one long conversation and for four, and far below an encoding of one whole.

    A whole-text encoding costs over 100 bytes of Python objects per token (the offsets as tuples of ints): encoded
    whole, these conversations peaked at 3.4 MB (one) and 4.3 MB (four); in windows at ~1.1 MB, one or four alike."""
    monkeypatch.setattr(stream, "WINDOW_CHARS", 4096)
    monkeypatch.setattr(stream, "MARGIN_CHARS", 256)
    monkeypatch.setattr(manifest_module, "ROW_GROUP_TOKENS", 1 << 14)  # one row group: 16 Ki tokens
    chars = 40_000
    warm = write_jsonl(tmp_path / "warm.jsonl", [_long_conversation(2_000, 9)])
    run_build(tmp_path / "warm", input=warm, row_tokens=256)  # one-time costs (the compiled template) not counted
    peaks = []
    for copies in (1, 4):
        source = write_jsonl(tmp_path / f"in{copies}.jsonl", [_long_conversation(chars, c) for c in range(copies)])
        tracemalloc.start()
        try:
            run_build(tmp_path / f"out{copies}", input=source, row_tokens=256)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    conversation_bytes = len(json.dumps(_long_conversation(chars, 0)))
    print(f"peak {peaks[0] / 1e6:.2f} MB for one, {peaks[1] / 1e6:.2f} MB for four conversations")
    assert peaks[1] < 1.25 * peaks[0]
    assert peaks[1] < 8 * conversation_bytes + 2_000_000


def test_a_parquet_input_is_memory_mapped_not_read_into_memory(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from openrecipes.data.sources import open_source

    records = [json.loads(line) for line in BUNDLED_CONVERSATIONS.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "in.parquet", row_group_size=100)
    before = pa.total_allocated_bytes()
    source, scan = open_source(tmp_path / "in.parquet")
    assert sum(1 for _ in scan) == len(records)
    table = source.files[0].table
    assert table.nbytes > 100_000 and pa.total_allocated_bytes() - before < table.nbytes // 10
    index, record = next(source.iter_records(np.array([len(records) - 1])))
    assert record == records[-1]


def test_the_limit_from_the_cli_and_the_recipe(tmp_path: Path) -> None:
    import argparse

    from openrecipes.config.recipe import DataBuild
    from openrecipes.data import cli as data_cli
    from openrecipes.data.build import build_recipe_rows

    small = tmp_path / "small.jsonl"
    small.write_text("".join(line + "\n" for line in BUNDLED_CONVERSATIONS.read_text().splitlines()[:24]))
    parser = argparse.ArgumentParser()
    data_cli.register(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["data", "build", str(small), "--loss-mask", "qwen3", "--row-tokens", "128", "--rows", "4",
                              "--max-conversation-tokens", "100", "--too-long", "truncate", "--no-progress",
                              "--out", str(tmp_path / "cli")])
    assert args.func(args) == 0
    manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert manifest["conversation_token_limit"] == {"max_tokens": 100, "too_long": "truncate"}
    assert manifest["counts"]["conversations_over_token_limit"] > 0
    build_recipe_rows(DataBuild(input=str(small), row_tokens=128, rows=4, max_conversation_tokens=100),
                      tmp_path / "recipe")
    manifest = json.loads((tmp_path / "recipe" / "manifest.json").read_text())
    assert manifest["conversation_token_limit"] == {"max_tokens": 100, "too_long": "skip"}
    with pytest.raises(ValueError, match="max_conversation_tokens"):
        DataBuild(format="pretrain", row_tokens=128, max_conversation_tokens=100)
    with pytest.raises(ValueError, match="too_long: truncate needs max_conversation_tokens"):
        DataBuild(row_tokens=128, too_long="truncate")
    args = parser.parse_args(["data", "build", "--row-tokens", "8", "--too-long", "truncate", "--out",
                              str(tmp_path / "none")])
    with pytest.raises(ValueError, match="^--too-long: truncate needs --max-conversation-tokens"):
        args.func(args)  # the flags are checked by the recipe's section, and named as flags
