import pytest
from .card_fixtures import QWEN_CARD

from openrecipes.config.safe_yaml import MAX_CARD_BYTES, UnsafeYamlError, load_plain_yaml, load_plain_yaml_file
from openrecipes.cards.validate import validate_paths


@pytest.mark.parametrize("text,line,words", [
    ("a: 1\nb: &x [1, 2]\nc: *x\n", 2, "anchor"),
    ("a: 1\nc: *x\n", 2, "alias"),
    ("a: 1\nb: !!python/object:os.system {}\n", 2, "python/object"),
    ("b: !!python/object/apply:os.system ['true']\n", 1, "python/object"),
    ("a: !!binary aGk=\n", 1, "binary"),
    ("a: !custom 3\n", 1, "!custom"),
    ("a: !!set {x}\n", 1, "set"),
    ("a:\n  x: 1\n  y: 2\n  x: 3\n", 4, "duplicate key 'x' (first at line 2)"),
    ("<<: {a: 1}\nb: 2\n", 1, "merge"),
    ("a: [1, 2\n", 2, "YAML syntax"),
    ("a: 1\nb: x\x1by\n", 2, "character 0x001b is not allowed in YAML"),  # raw control characters YAML's reader
    ("a: 1\n\nb: \x00\n", 3, "character 0x0000 is not allowed in YAML"),  # refuses: one line, not its traceback
])
def test_hostile_yaml_is_rejected_with_file_and_line(text, line, words):
    with pytest.raises(UnsafeYamlError) as caught:
        load_plain_yaml(text, source="cards/x.yaml")
    assert caught.value.line == line
    assert words in caught.value.message
    assert str(caught.value).startswith(f"cards/x.yaml:{line}:")


def test_plain_yaml_loads_with_line_map():
    data, lines = load_plain_yaml("a: 1\nb:\n  - x\n  - {c: 2026-01-02}\n")
    assert data["b"][1]["c"].isoformat() == "2026-01-02"
    assert lines[("b", 1, "c")] == 4 and lines[("b",)] == 2


def test_deep_nesting_is_rejected():
    with pytest.raises(UnsafeYamlError, match="nesting"):
        load_plain_yaml("a: " + "[" * 100 + "]" * 100 + "\n")


def test_oversized_file_is_rejected_before_parsing(tmp_path):
    path = tmp_path / "huge.yaml"
    line = "k: " + "x" * 1000 + "\n"
    path.write_text(line * (MAX_CARD_BYTES // len(line) + 2))
    with pytest.raises(UnsafeYamlError) as caught:
        load_plain_yaml_file(path)
    assert str(path) in str(caught.value) and "limit" in caught.value.message
    assert caught.value.line == MAX_CARD_BYTES // len(line) + 1


def test_hostile_card_fails_validation_naming_the_file(tmp_path):
    text = QWEN_CARD.read_text().replace("status: verified", "status: !!python/object:builtins.str verified")
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    _, problems = validate_paths([path])
    assert len(problems) == 1 and problems[0].file == str(path)
    assert problems[0].line == next(i for i, l in enumerate(text.splitlines(), 1) if l.startswith("status:"))
