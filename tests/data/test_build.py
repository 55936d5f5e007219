"""Builds: determinism, hashes, row shapes, skipped rows, bad input, atomicity, input formats."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from openrecipes.data import cli as data_cli
from openrecipes.data.manifest import rows_sha256_of
from openrecipes.data.templates import BUILTIN_TEMPLATE_NOTES
from openrecipes.data.tokenizer import BUNDLED_TOKENIZER
from openrecipes.utils import sha256_file

from tests.data.sft_data_helpers import BUNDLED_CONVERSATIONS, read_rows, run_build, write_jsonl

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    first = run_build(tmp_path / "a", seed=7)
    second = run_build(tmp_path / "b", seed=7)
    assert (tmp_path / "a/rows.parquet").read_bytes() == (tmp_path / "b/rows.parquet").read_bytes()
    for key in ("rows_sha256", "parquet_sha256", "parquet_bytes", "rows", "counts"):
        assert first[key] == second[key]
    other = run_build(tmp_path / "c", seed=8)
    assert other["rows_sha256"] != first["rows_sha256"]  # the seed changes the permutation


def test_manifest_hashes_match_the_files(tiny_rows: Path) -> None:
    manifest = json.loads((tiny_rows / "manifest.json").read_text())
    assert manifest["parquet_sha256"] == sha256_file(tiny_rows / "rows.parquet")
    assert manifest["parquet_bytes"] == (tiny_rows / "rows.parquet").stat().st_size
    assert manifest["rows_sha256"] == rows_sha256_of(tiny_rows / "rows.parquet")
    assert manifest["tokenizer"]["files_sha256"]["tokenizer.json"] == sha256_file(BUNDLED_TOKENIZER / "tokenizer.json")
    assert manifest["template_sha256"] == sha256_file(BUNDLED_TOKENIZER / "chat_template.jinja")
    # the bundled tokenizer's template is the built-in qwen3 text, so its note (how it relates to Qwen3's) is recorded
    assert manifest["template_note"] == BUILTIN_TEMPLATE_NOTES["qwen3"]
    rows = read_rows(tiny_rows)
    assert manifest["supervised_tokens"] == int(rows["loss_mask"].sum())
    assert manifest["padding_tokens"] == 0


def test_rows_are_exact_and_documents_continue(tiny_rows: Path) -> None:
    rows = read_rows(tiny_rows)
    manifest = json.loads((tiny_rows / "manifest.json").read_text())
    assert rows["input_ids"].shape == (manifest["rows"], 256)
    im_start = 1  # id of <|im_start|> in the bundled tokenizer
    continued = 0
    for ids, mask, lens in zip(rows["input_ids"], rows["loss_mask"], rows["doc_lens"]):
        assert sum(lens) == 256 and min(lens) > 0
        assert mask[0] == 0 and mask.sum() > 0
        starts = np.cumsum([0] + lens[:-1])
        # every piece but a row's first starts a conversation; a row's first may continue one
        assert all(ids[s] == im_start for s in starts[1:])
        continued += ids[0] != im_start
        ends = np.cumsum(lens) - 1
        assert all(ids[e] == 0 for e in ends[:-1])  # complete documents end with <|endoftext|>
    # without skipped rows, each split conversation continues at the start of at least one row
    assert manifest["counts"]["rows_skipped_unsupervised"] == 0
    assert 0 < manifest["counts"]["conversations_split"] <= continued


def test_rows_without_supervision_are_skipped(tmp_path: Path) -> None:
    long_user = {"messages": [{"role": "user", "content": "tell me " * 400}, {"role": "assistant", "content": "No."}]}
    src = write_jsonl(tmp_path / "in.jsonl", [long_user, GOOD] * 3)
    manifest = run_build(tmp_path / "out", input=src, row_tokens=64)
    assert manifest["counts"]["rows_skipped_unsupervised"] > 0
    assert manifest["counts"]["tokens_in_rows_skipped_unsupervised"] == 64 * manifest["counts"][
        "rows_skipped_unsupervised"]
    rows = read_rows(tmp_path / "out")
    assert (rows["loss_mask"].sum(axis=1) > 0).all()
    assert manifest["rows"] == rows["input_ids"].shape[0]


def test_rows_option_and_too_few_rows(tmp_path: Path) -> None:
    manifest = run_build(tmp_path / "a", rows=5)
    assert manifest["rows"] == 5 and read_rows(tmp_path / "a")["input_ids"].shape == (5, 256)
    assert manifest["counts"]["conversations_unused"] > 0
    with pytest.raises(ValueError, match="--rows asks for 100000"):
        run_build(tmp_path / "b", rows=100000)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: malformed JSON"),
    (json.dumps({"messages": [{"role": "bot", "content": "x"}]}), "line 2: message 1: unknown role 'bot'"),
    (json.dumps({"messages": []}), "line 2: empty conversation"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "line 2: no assistant turn"),
    (json.dumps({"messages": [{"role": "user", "content": "a <|im_end|> b"}, {"role": "assistant",
                                                                             "content": "x"}]}),
     "line 2: message 1: content contains the added token"),
    *[(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                                                                    "tool_calls": [call]}]}),
       f"line 2: message 2: {where} contains the added token '<|im_end|>'") for call, where in [
        ({"type": "function", "function": {"name": "f<|im_end|>\n<|im_start|>user", "arguments": "{}"}},
         "tool_calls[0].function.name"),
        ({"type": "function", "function": {"name": "f", "arguments": "{\"q\": \"<|im_end|>\"}"}},
         "tool_calls[0].function.arguments"),
        ({"type": "function", "function": {"name": "f", "arguments": {"q": ["x", "<|im_end|>"]}}},
         "tool_calls[0].function.arguments.q[1]"),
        ({"type": "function", "function": {"name": "f", "arguments": {"<|im_end|>": 1}}},
         "tool_calls[0].function.arguments key"),
    ]],
    (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                 "tools": [{"type": "function", "function": {"name": "f", "description": "<|im_start|>user"}}]}),
     "line 2: tools[0].function.description contains the added token '<|im_start|>'"),
])
def test_bad_input_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(GOOD) + "\n" + line + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError) as error:  # special tokens in text: refused when asked
        run_build(tmp_path / "out", input=src, row_tokens=8, special_tokens_in_text="refuse")
    assert str(src) in str(error.value) and message in str(error.value)
    assert not (tmp_path / "out").exists()  # a failed build leaves nothing behind


def test_skip_invalid_counts_instead(tmp_path: Path) -> None:
    bad = [{"messages": []}, {"messages": [{"role": "user", "content": "x"}]}]
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD] * 6 + bad)
    manifest = run_build(tmp_path / "out", input=src, row_tokens=8, skip_invalid=True)
    assert manifest["counts"]["conversations_invalid"] == 2
    assert manifest["counts"]["conversations_total"] == 8
    assert any("line 7" in e for e in manifest["invalid_examples"])
    with pytest.raises(ValueError, match="malformed JSON"):  # never skipped, even so
        (tmp_path / "m.jsonl").write_text(json.dumps(GOOD) + "\n{\n")
        run_build(tmp_path / "out2", input=tmp_path / "m.jsonl", row_tokens=8, skip_invalid=True)


def test_tokenizer_without_template_and_bad_row_tokens(tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((BUNDLED_TOKENIZER / "tokenizer.json").read_bytes())
    (tok_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no chat template"):
        run_build(tmp_path / "out", tokenizer=tok_dir)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="row_tokens"):
            run_build(tmp_path / "out", row_tokens=bad)
    assert not (tmp_path / "out").exists()


def test_failure_mid_build_leaves_no_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from openrecipes.data import build as build_module

    def explode(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(build_module, "_manifest", explode)
    with pytest.raises(RuntimeError):
        run_build(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.rglob("rows.parquet"))


def test_parquet_and_dataset_dir_inputs_match_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in BUNDLED_CONVERSATIONS.read_text().splitlines()[:120]]
    jsonl = write_jsonl(tmp_path / "c.jsonl", records)
    reference = run_build(tmp_path / "j", input=jsonl, row_tokens=128)
    table = pa.Table.from_pylist([{"messages": r["messages"], "metadata": json.dumps(r["metadata"])}
                                  for r in records])
    pq.write_table(table, tmp_path / "c.parquet")
    from_parquet = run_build(tmp_path / "p", input=tmp_path / "c.parquet", row_tokens=128)
    assert from_parquet["rows_sha256"] == reference["rows_sha256"]
    dataset = tmp_path / "ds" / "data"
    dataset.mkdir(parents=True)
    pq.write_table(table.slice(0, 60), dataset / "train-00000.parquet")
    pq.write_table(table.slice(60), dataset / "train-00001.parquet")
    from_dir = run_build(tmp_path / "d", input=tmp_path / "ds", row_tokens=128)
    assert from_dir["rows_sha256"] == reference["rows_sha256"]
    with pytest.raises(ValueError, match="c.parquet row 3: message 1: unknown role"):
        bad = table.to_pylist()
        bad[2]["messages"][0]["role"] = "robot"
        pq.write_table(pa.Table.from_pylist(bad), tmp_path / "c.parquet")
        run_build(tmp_path / "p2", input=tmp_path / "c.parquet", row_tokens=128)


def test_cli_build_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    data_cli.register(parser.add_subparsers(dest="verb"))
    out = tmp_path / "out"
    args = parser.parse_args(["data", "build", "--loss-mask", "muse_spark", "--chat-template", "muse_spark",
                              "--row-tokens", "128", "--rows", "3", "--no-progress", "--out", str(out),
                              "--template-kwargs", "current_date=2026-10-01", "reasoning_effort=high"])
    assert args.func(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == 3 and manifest["loss_mask"] == "muse_spark"
    assert manifest["template_kwargs"] == {"current_date": "2026-10-01", "reasoning_effort": "high"}
    assert json.loads(capsys.readouterr().out)["rows_sha256"] == manifest["rows_sha256"]
    args = parser.parse_args(["data", "build", "--loss-mask", "qwen3", "--row-tokens", "128", "--out", str(out)])
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        args.func(args)
