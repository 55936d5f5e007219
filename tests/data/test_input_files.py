"""Input files as datasets ship them: a JSON array of records (``.json``) reads as the same records in JSON Lines,
and a ShareGPT record read with the default shape is named as ShareGPT."""

from __future__ import annotations

import json

import numpy as np
import pytest

from openrecipes.cli import main
from tests.data.sft_data_helpers import BUNDLED_CONVERSATIONS, BUNDLED_TOKENIZER, read_rows, run_build, write_jsonl

RECORDS = [json.loads(line) for line in BUNDLED_CONVERSATIONS.read_text().splitlines()[:24]]


def data_build(input_path, out, *extra):
    return main(["data", "build", str(input_path), "--tokenizer", str(BUNDLED_TOKENIZER), "--loss-mask", "qwen3",
                 "--row-tokens", "64", "--rows", "4", "--no-progress", "--out", str(out), *extra])


def test_a_json_array_builds_the_rows_its_json_lines_build(tmp_path):
    lines = write_jsonl(tmp_path / "records.jsonl", RECORDS)
    array = tmp_path / "records.json"
    array.write_text(json.dumps(RECORDS, indent=2))
    assert data_build(lines, tmp_path / "from-lines") == 0 and data_build(array, tmp_path / "from-array") == 0
    expected, got = read_rows(tmp_path / "from-lines"), read_rows(tmp_path / "from-array")
    assert np.array_equal(expected["input_ids"], got["input_ids"])
    assert np.array_equal(expected["loss_mask"], got["loss_mask"])
    manifest = json.loads((tmp_path / "from-array" / "manifest.json").read_text())
    assert manifest["counts"] == json.loads((tmp_path / "from-lines" / "manifest.json").read_text())["counts"]


def test_a_json_file_of_json_lines_reads_as_json_lines(tmp_path):
    as_json = write_jsonl(tmp_path / "records.json", RECORDS)  # datasets' to_json writes JSON Lines under .json
    summary = run_build(tmp_path / "out", input=as_json, row_tokens=64, rows=4)
    assert summary["rows"] == 4


@pytest.mark.parametrize("text, message", [
    ('{\n"data": []\n}', "records.json line 1: malformed JSON: "),  # one object over lines: neither kind
    ('{\n"data": []\n}', "(a .json input holds a JSON array of records or JSON Lines)"),
    ('[{"messages": [}]', "records.json: line 1: malformed JSON"),
    ('[{"nothing": 1}]', "records.json record 1: expected an object with a 'messages' list"),
])
def test_a_bad_json_input_is_named(tmp_path, capsys, text, message):
    path = tmp_path / "records.json"
    path.write_text(text)
    assert data_build(path, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_sharegpt_read_as_openai_is_named_with_the_option_to_pass(tmp_path, capsys):
    sharegpt = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}] * 40
    path = write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt)
    assert data_build(path, tmp_path / "out") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"openrecipes data: error: {path} line 1: expected an object with a 'messages' list; it looks like ShareGPT "
        "(a 'conversations' list of from/value turns): pass --input-shape sharegpt (data.build.input_shape in a "
        "recipe)"]
    openai = write_jsonl(tmp_path / "openai.jsonl", RECORDS)
    assert data_build(openai, tmp_path / "out", "--input-shape", "sharegpt") == 2
    assert "it looks like OpenAI messages" in capsys.readouterr().err
    assert data_build(path, tmp_path / "out", "--input-shape", "sharegpt") == 0
