"""`card schema --out` writes a new file or replaces an earlier schema of the same card, nothing else."""

from __future__ import annotations

import json

import pytest

from openrecipes.cli import main


def test_an_earlier_schema_is_replaced(tmp_path, capsys):
    out = tmp_path / "recipe.schema.json"
    out.write_text(json.dumps({"title": "OpenRecipes recipe card", "stale": True}))
    assert main(["card", "schema", "--out", str(out)]) == 0
    assert "stale" not in json.loads(out.read_text())


@pytest.mark.parametrize("text", ["my notes\n", "name: my recipe\n",
                                  json.dumps({"title": "OpenRecipes verification card"})])
def test_any_other_file_is_kept(tmp_path, capsys, text):
    out = tmp_path / "file"
    out.write_text(text)
    assert main(["card", "schema", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a JSON Schema of the OpenRecipes recipe card" in err, err
    assert out.read_text() == text
