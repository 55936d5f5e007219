"""Numerics rules: the classification is complete and `verify rules` fails on numerics-affecting differences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from openrecipes.cli import main
from openrecipes.config.recipe import Recipe, recipe_from_dict
from openrecipes.config.numerics import (
    FIELD_RULES,
    NUMERICS,
    PERFORMANCE,
    field_paths,
    numerics_fields,
    performance_only_fields,
)
from openrecipes.verify.rules import compare_recipes


def _tree(**changes) -> dict:
    tree = {"model": "qwen3-moe-tiny", "data": {"rows": "/data/rows"}, "layout": {"max_tokens_per_gpu": 128},
            "steps": 6, "global_batch": 4, "optimizer": {"lr": 3e-3}, "run_dir": "runs/a"}
    for dotted, value in changes.items():
        node = tree
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _write(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def test_every_recipe_field_is_classified_once():
    paths = field_paths(Recipe)
    unclassified = sorted(set(paths) - set(FIELD_RULES))
    assert not unclassified, f"classify these recipe fields in openrecipes/verify/rules.py: {unclassified}"
    stale = sorted(set(FIELD_RULES) - set(paths))
    assert not stale, f"rules for fields the recipe no longer has: {stale}"
    assert len(paths) == len(set(paths))
    for path, rule in FIELD_RULES.items():
        assert rule.path == path and rule.kind in (NUMERICS, PERFORMANCE) and len(rule.reason) > 10


def test_walker_recurses_into_optional_sections():
    class Inner(BaseModel):
        a: int = 1
        b: dict[str, int] = {}

    class Outer(BaseModel):
        x: str = ""
        inner: Inner | None = None
        required: Inner

    assert field_paths(Outer) == ["x", "inner.a", "inner.b", "required.a", "required.b"]
    # the real tree reaches the sections nested two deep and behind `| None`
    assert {"data.build.row_tokens", "layout.dp", "optimizer.betas"} <= set(field_paths(Recipe))


def test_classification_follows_the_design():
    numerics, performance = set(numerics_fields()), set(performance_only_fields())
    assert not numerics & performance
    for path in ("model", "model_overrides", "init", "data.rows", "precision", "steps", "global_batch", "seed",
                 "debug.force_load_balance", "debug.skip_nonfinite_steps"):
        assert path in numerics, path
    assert {p for p in FIELD_RULES if p.startswith("optimizer.")} <= numerics
    assert {p for p in FIELD_RULES if p.startswith("data.build.")} <= numerics
    for prefix in ("layout.", "recompute.", "offload.", "checkpoint.", "logging.", "kernels."):
        assert {p for p in FIELD_RULES if p.startswith(prefix)} <= performance, prefix
    assert {"run_dir", "name", "distributed_timeout_minutes"} <= performance


def test_identical_recipes_pass(tmp_path, capsys):
    a = _write(tmp_path / "a.yaml", _tree())
    b = _write(tmp_path / "b.yaml", _tree())
    assert main(["verify", "rules", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "numerics-affecting differences: none" in out


def test_changed_lr_fails_and_names_the_field(tmp_path, capsys):
    a = _write(tmp_path / "a.yaml", _tree(optimizer__lr=1e-3))
    b = _write(tmp_path / "b.yaml", _tree())
    assert main(["verify", "rules", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "optimizer.lr: 0.001 (candidate) vs 0.003 (reference)" in out


def test_changed_dp_passes_and_is_listed(tmp_path, capsys):
    a = _write(tmp_path / "a.yaml", _tree(layout__dp=2, run_dir="runs/b"))
    b = _write(tmp_path / "b.yaml", _tree())
    assert main(["verify", "rules", str(a), str(b), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is True and data["numerics"] == []
    assert [(d["path"], d["candidate"], d["reference"]) for d in data["performance"]] == [
        ("layout.dp", 2, 1), ("run_dir", "runs/b", "runs/a")]


def test_run_directories_stand_for_their_recipe(tmp_path, capsys):
    for name, lr in (("cand", 3e-3), ("ref", 3e-4)):
        (tmp_path / name).mkdir()
        _write(tmp_path / name / "recipe.yaml", _tree(optimizer__lr=lr))
    assert main(["verify", "rules", str(tmp_path / "cand"), str(tmp_path / "ref")]) == 1
    assert "optimizer.lr" in capsys.readouterr().out


def test_rows_by_content_and_sections_set_on_one_side(tmp_path):
    for name in ("copy1", "copy2", "other"):
        (tmp_path / name).mkdir()
        digest = "b" * 64 if name == "other" else "a" * 64
        (tmp_path / name / "manifest.json").write_text(json.dumps({"rows_sha256": digest}))
    rows = lambda name: recipe_from_dict(_tree(data={"rows": str(tmp_path / name)}))  # noqa: E731
    assert compare_recipes(rows("copy1"), rows("copy2")).passed
    report = compare_recipes(rows("copy1"), rows("other"))
    assert [d.path for d in report.numerics] == ["data.rows"]

    built = recipe_from_dict(_tree(data={"build": {"row_tokens": 64}}))
    report = compare_recipes(built, rows("copy1"))
    assert [d.path for d in report.numerics] == ["data.rows", "data.build"]
    assert report.numerics[1].candidate["row_tokens"] == 64 and report.numerics[1].reference is None


def test_lora_fields_change_numerics_and_its_layouts_do_not():
    lora_paths = {p for p in field_paths(Recipe) if p.startswith("lora.")}
    assert lora_paths == {"lora.rank", "lora.alpha", "lora.dropout", "lora.targets"}
    assert lora_paths <= set(numerics_fields())
    adapted = recipe_from_dict(_tree(lora={"rank": 4, "targets": ["q_proj", "experts"]}))
    # training adapters on a frozen base is another update than training the whole model: one line, the section
    report = compare_recipes(adapted, recipe_from_dict(_tree()))
    assert [d.path for d in report.numerics] == ["lora"] and report.numerics[0].reference is None
    for change, path in (({"rank": 8}, "lora.rank"), ({"alpha": 4.0}, "lora.alpha"),
                         ({"targets": ["q_proj"]}, "lora.targets")):
        other = recipe_from_dict(_tree(lora={"rank": 4, "targets": ["q_proj", "experts"], **change}))
        assert [d.path for d in compare_recipes(other, adapted).numerics] == [path]
    # LoRA runs under every layout: a layout change stays performance-only
    split = recipe_from_dict(_tree(lora={"rank": 4, "targets": ["q_proj", "experts"]},
                                   layout={"max_tokens_per_gpu": 128, "tp": 2, "sequence_parallel": True, "ep": 2}))
    report = compare_recipes(split, adapted)
    assert report.passed and {d.path for d in report.performance} == {"layout.tp", "layout.sequence_parallel",
                                                                      "layout.ep"}


@pytest.mark.parametrize("text, needle", [
    ("model: qwen3-moe-tiny\noptimizer: {lrr: 1}\n", "optimizer.lrr"),
    ("model: [unclosed\n", "a.yaml"),
    ("- a list\n", "mapping"),
])
def test_malformed_recipe_is_a_clear_error(tmp_path, capsys, text, needle):
    bad = tmp_path / "a.yaml"
    bad.write_text(text)
    good = _write(tmp_path / "b.yaml", _tree())
    assert main(["verify", "rules", str(bad), str(good)]) == 2
    err = capsys.readouterr().err
    assert "error" in err and needle in err


def test_missing_recipe_is_exit_2(tmp_path, capsys):
    good = _write(tmp_path / "b.yaml", _tree())
    assert main(["verify", "rules", str(tmp_path / "nope.yaml"), str(good)]) == 2
    assert "nope.yaml" in capsys.readouterr().err
