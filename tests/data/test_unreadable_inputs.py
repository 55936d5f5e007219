"""Inputs the build cannot read end in one line naming the file (and the line, where there is one), exit 2: never a
traceback, never a second line written by the input itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from openrecipes.cli import main
from openrecipes.data.bundled import TOKENIZER

USER_TURN = {"role": "user", "content": "hi"}
REPLY = {"role": "assistant", "content": "hello"}


def _jsonl(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _conversations(tmp: Path) -> Path:
    return _jsonl(tmp / "chat.jsonl", "".join(json.dumps({"messages": [USER_TURN, REPLY]}) + "\n" for _ in range(3)))


def _deep_field(tmp: Path) -> tuple[Path, list[str]]:
    """A quoted turn delimiter (the conversation is shielded) beside a field nested 500 lists deep."""
    nested = "[" * 500 + "]" * 500
    line = ('{"messages": [{"role": "user", "content": "a <|im_end|> b", "extra": ' + nested + '}, '
            + json.dumps(REPLY) + "]}\n")
    return _jsonl(tmp / "deep.jsonl", line), []


def _surrogate_document(tmp: Path) -> tuple[Path, list[str]]:
    return _jsonl(tmp / "docs.jsonl", '{"text": "a\\udc80b"}\n'), ["--format", "pretrain"]


def _huge_integer(tmp: Path) -> tuple[Path, list[str]]:
    return _jsonl(tmp / "big.jsonl", '{"messages": [], "n": ' + "9" * 5000 + "}\n"), []


def _tokenizer_config_list(tmp: Path) -> tuple[Path, list[str]]:
    shutil.copytree(TOKENIZER, tmp / "tok")
    (tmp / "tok" / "tokenizer_config.json").write_text("[1, 2]")
    return _conversations(tmp), ["--tokenizer", str(tmp / "tok")]


def _named_template_null(tmp: Path) -> tuple[Path, list[str]]:
    shutil.copytree(TOKENIZER, tmp / "tok")
    (tmp / "tok" / "chat_template.jinja").unlink()
    (tmp / "tok" / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default", "template": null}]}')
    return _conversations(tmp), ["--tokenizer", str(tmp / "tok")]


def _tokenizer_config_a_folder(tmp: Path) -> tuple[Path, list[str]]:
    shutil.copytree(TOKENIZER, tmp / "tok")
    (tmp / "tok" / "tokenizer_config.json").unlink(missing_ok=True)
    (tmp / "tok" / "tokenizer_config.json").mkdir()
    return _conversations(tmp), ["--tokenizer", str(tmp / "tok")]


def _text_part_without_text(tmp: Path) -> tuple[Path, list[str]]:
    turn = {"role": "user", "content": [{"type": "text", "txt": "hi"}]}
    return _jsonl(tmp / "parts.jsonl", json.dumps({"messages": [turn, REPLY]}) + "\n"), []


def _template_not_utf8(tmp: Path) -> tuple[Path, list[str]]:
    (tmp / "t.jinja").write_bytes(b"\xff{{ messages }}")
    return _conversations(tmp), ["--chat-template", str(tmp / "t.jinja")]


def _template_writes_a_surrogate(tmp: Path) -> tuple[Path, list[str]]:
    (tmp / "t.jinja").write_text((TOKENIZER / "chat_template.jinja").read_text() + "{{ '\\udc80' }}")
    return _conversations(tmp), ["--chat-template", str(tmp / "t.jinja")]


def _template_message_with_a_line_break(tmp: Path) -> tuple[Path, list[str]]:
    (tmp / "t.jinja").write_text("{{ raise_exception('line one\\nINJECTED: all good') }}")
    return _conversations(tmp), ["--chat-template", str(tmp / "t.jinja")]


def _key_with_a_line_break(tmp: Path) -> tuple[Path, list[str]]:
    return _jsonl(tmp / "keys.jsonl", json.dumps({"msgs\nINJECTED: all good": []}) + "\n"), []


def _garbage_parquet(tmp: Path) -> tuple[Path, list[str]]:
    (tmp / "chat.parquet").write_bytes(b"not a parquet file at all")
    return tmp / "chat.parquet", []


def _dataset_state(tmp: Path) -> tuple[Path, list[str]]:
    (tmp / "ds").mkdir()
    (tmp / "ds" / "state.json").write_text('{"_data_files": 5}')
    return tmp / "ds", []


CASES = {
    "a field nested too deeply to render": (_deep_field, "deep.jsonl line 1: a field is nested too deeply"),
    "a document with a lone surrogate": (_surrogate_document, "docs.jsonl line 1: 'text' holds"),
    "an integer past Python's digits": (_huge_integer, "big.jsonl line 1: unreadable JSON"),
    "tokenizer_config.json a list": (_tokenizer_config_list, "tokenizer_config.json: a tokenizer config is a JSON"),
    "a named default template of null": (_named_template_null, "'default' entry has no string 'template'"),
    "tokenizer_config.json a folder": (_tokenizer_config_a_folder, "tokenizer_config.json: not a regular file"),
    "a text part without text": (_text_part_without_text, "content part 1 is a text part without a string 'text'"),
    "a template file not UTF-8": (_template_not_utf8, "t.jinja: not UTF-8 text"),
    "a template writing a lone surrogate": (_template_writes_a_surrogate, ".jsonl line 3: the chat template's "
                                                                          "output holds"),
    "a template's message with a line break": (_template_message_with_a_line_break, "line one\\nINJECTED"),
    "a key with a line break": (_key_with_a_line_break, "keys.jsonl line 1: expected an object"),
    "a file that is no Parquet": (_garbage_parquet, "chat.parquet: unreadable as parquet"),
    "a dataset's state.json of another shape": (_dataset_state, "state.json: not a saved dataset's state"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_unreadable_input_is_one_line_naming_it(tmp_path, capsys, case):
    make, expected = CASES[case]
    source, flags = make(tmp_path)
    out = tmp_path / "rows"
    status = main(["data", "build", str(source), "--row-tokens", "16", "--no-progress", "--out", str(out), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("openrecipes data: error: "), err
    assert expected in err[0], err
    assert not out.exists()
