import re

import pytest
from .card_fixtures import CATALOG, MUSE_CARD, QWEN_CARD, REPO

from openrecipes.cards.cli import _schema
from openrecipes.cards.schema import RecipeCard, card_json_schema_text
from openrecipes.cards.validate import validate_paths

SCHEMA_FILE = REPO / "schema" / "recipe.schema.json"
SEEDS = REPO.parent / "shared" / "seeds"


def test_checked_in_schema_is_fresh():
    assert SCHEMA_FILE.read_text() == card_json_schema_text(), (
        "schema/recipe.schema.json is stale: run `python -m openrecipes.cards schema --out "
        "schema/recipe.schema.json`")


def test_schema_check_flags_a_stale_file(tmp_path, capsys):
    import argparse

    stale = tmp_path / "recipe.schema.json"
    stale.write_text(card_json_schema_text().replace('"tp"', '"tensor_parallel"'))
    args = argparse.Namespace(out=stale, check=True, kind="recipe")
    assert _schema(args) == 1
    stale.write_text(card_json_schema_text())
    assert _schema(args) == 0


def test_schema_lists_every_top_level_field():
    import json

    schema = json.loads(card_json_schema_text())
    assert set(schema["properties"]) == set(RecipeCard.model_fields)
    assert schema["additionalProperties"] is False
    assert {"curves", "run", "correctness", "layout"} <= set(schema["properties"])


def test_catalog_validates_without_errors():
    cards, problems = validate_paths([CATALOG])
    assert [str(p) for p in problems if p.severity == "error"] == []
    assert {c.path.resolve() for c in cards} >= {QWEN_CARD.resolve(), MUSE_CARD.resolve()}


def _seed_yaml(prefix: str) -> str:
    matches = sorted(SEEDS.glob(f"{prefix}_*.txt"))
    if not matches:
        pytest.skip("seed documents not available beside the repository")
    text = matches[0].read_text()
    return text[text.index("# recipes/"):]


@pytest.mark.parametrize("prefix,card", [("000", MUSE_CARD), ("004", QWEN_CARD)])
def test_catalog_cards_keep_the_published_figures(prefix, card, tmp_path):
    seed_text = _seed_yaml(prefix)
    # the published YAML itself is a valid card
    seed_file = tmp_path / "seed.yaml"
    seed_file.write_text(seed_text)
    _, problems = validate_paths([seed_file])
    assert [str(p) for p in problems if p.severity == "error"] == []

    def body(text: str) -> list[str]:
        lines = [line for line in text.splitlines() if not line.startswith("#")]
        return [line for line in lines if not re.fullmatch(r"\s+workflow: \w+", line)]

    assert body(card.read_text()) == body(seed_text)
