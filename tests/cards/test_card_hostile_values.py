"""Values no real card holds, which a hostile or broken one may: each is a one-line error naming the field."""

from __future__ import annotations

import pytest

from openrecipes.cards.validate import validate_paths
from openrecipes.cli import main


def _errors(path):
    _, problems = validate_paths([path])
    return [str(p) for p in problems if p.severity == "error"]


@pytest.mark.parametrize("where, value, words", [
    (("result", "active_params", "count"), 10**400, "integer of 401 digits"),  # was an OverflowError
    (("workload", "global_batch"), 10**30, "integer of 31 digits"),
    (("result", "tokens_per_s_per_gpu"), 5e-324, "nonzero but below"),  # was a ZeroDivisionError
    (("run",), "openrecipes train \u202erecipe.yaml", "bidi character '\\u202e'"),
    (("layout", "label"), "TP1\x1b[31m", "control or bidi character '\\x1b'"),
], ids=["huge-int", "30-digit-int", "subnormal-float", "bidi-override", "escape"])
def test_an_out_of_range_number_or_hidden_character_names_its_field(qwen, write_card, where, value, words):
    target = qwen
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    path = write_card(qwen)
    errors = _errors(path)
    assert len(errors) == 1 and words in errors[0], errors
    assert errors[0].startswith(f"{path}:") and f" {'.'.join(where)}: " in errors[0]
    assert len(errors[0]) < 400


def test_a_huge_rejected_value_is_quoted_short(qwen, write_card):
    qwen["status"] = "x" * 500_000
    (error,) = _errors(write_card(qwen))
    assert "status: Input should be" in error and "(500002 characters)" in error and len(error) < 400


def test_a_key_with_line_breaks_or_escapes_stays_on_one_line(qwen, write_card):
    qwen["env"] = {"A\nB\x1b[31m": 5}
    (error,) = _errors(write_card(qwen))
    assert "\n" not in error and "\x1b" not in error
    assert "env['A\\nB\\x1b[31m']: Input should be a valid string" in error


def test_a_card_file_name_with_a_line_break_stays_on_one_line(qwen, write_card):
    qwen["layout"]["tp"] = "1"
    (error,) = _errors(write_card(qwen, name="a\nb.yaml"))
    assert "\n" not in error and "a\\nb.yaml:" in error


def test_card_new_refuses_an_author_url_that_is_no_web_address(tmp_path, capsys):
    out = tmp_path / "card.yaml"
    # refused before any run is read: the run directories need not exist
    code = main(["card", "new", str(tmp_path / "run"), "--reference", str(tmp_path / "ref"), "--out", str(out),
                 "--author", "a", "--author-url", "javascript:alert(1)"])
    assert code == 2 and not out.exists()
    assert "--author-url: not an http(s) address: 'javascript:alert(1)'" in capsys.readouterr().err
