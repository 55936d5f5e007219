"""Absolute machine paths on a card: an error on a catalog card, a warning elsewhere; the catalog has none."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
from pathlib import Path

import pytest
import yaml
from .card_fixtures import CATALOG, REPO

from openrecipes.cards.cli import _validate
from openrecipes.cards.paths import absolute_paths, is_catalog_path, named_by_file, paths_in_text, relative_to
from openrecipes.cards.validate import find_card_files, validate_file, validate_paths

TUNED_CARD = CATALOG / "qwen3-30b-a3b" / "h200" / "qwen3-30b-a3b-16l-tune-start-tuned.yaml"


@pytest.mark.parametrize("text, found", [
    ("openrecipes train /tmp/tune/trials/003/recipe.yaml --nproc 1", ["/tmp/tune/trials/003/recipe.yaml"]),
    ("measured from run directory /home/u/runs/x (started 2026-12-01)", ["/home/u/runs/x"]),
    ("rows: '/work/main/tune-rows'.", ["/work/main/tune-rows"]),
    ("PYTHONPATH=/tmp/ors:/work/src", ["/tmp/ors", "/work/src"]),
    ("cache in /.cache/x and ~/data/y", ["/.cache/x", "~/data/y"]),
    ("C:\\Users\\me\\rows and \\\\host\\share\\rows", ["C:\\Users\\me\\rows", "\\\\host\\share\\rows"]),
    ("file:///tmp/x.jsonl", ["file:///tmp/x.jsonl"]),
    ("6,913.2 tokens/s/GPU at 0.32 $/1M tokens, 1/3 of the steps, 2026/12/01, TP/PP, a / b", []),
    ("https://huggingface.co/Qwen/x, hf://org/model, s3://bucket/key, https://h/p?x=/tmp/y", []),
    ("recipes/qwen3-30b-a3b/h200/x.recipe.yaml, ./rel/x, ../up/y, `scripts/run.py`, /1M, ~10/s", []),
    # other spellings of the same: a file URL in any case, a device path, a folder that starts with a digit or -,
    # a shell default, environment variables that name a home or profile folder
    ("FILE:///tmp/x and File:///home/a", ["FILE:///tmp/x", "File:///home/a"]),
    ("\\\\?\\C:\\Users\\a", ["\\\\?\\C:\\Users\\a"]),
    ("/2024data/a, /-scratch/a", ["/2024data/a", "/-scratch/a"]),
    ("${DATA:-/home/a/rows}", ["/home/a/rows"]),
    ("%USERPROFILE%\\rows, $HOME/rows, ${HOME}/x", ["%USERPROFILE%\\rows", "$HOME/rows", "${HOME}/x"]),
    ("+/-5 %, -/3, /3, 2-3/4 of the steps", []),
    ("$KERNEL_CACHE/tilelang", []),  # the recipe's own variable: the reader sets it
])
def test_paths_in_text(text, found):
    assert paths_in_text(text) == found


def test_absolute_paths_walks_the_tree_with_dotted_field_paths():
    tree = {"run": "openrecipes train /tmp/r.yaml", "workload": {"dataset": {"source": "/data/docs.jsonl"}},
            "correctness": {"component_tests": [{"note": "ok"}, {"note": "see ~/x/y"}]}, "result": {"mfu": 0.19}}
    assert absolute_paths(tree) == [("run", "/tmp/r.yaml"), ("workload.dataset.source", "/data/docs.jsonl"),
                                    ("correctness.component_tests[1].note", "~/x/y")]


def _errors(problems):
    return [p for p in problems if p.severity == "error"]


def test_a_path_as_a_mapping_key_is_found():
    assert absolute_paths({"env": {"/home/a/.cache": "1", "HF_HOME": "hub"}}) == [("env./home/a/.cache",
                                                                                     "/home/a/.cache")]


def test_a_published_card_with_an_absolute_run_or_notes_path_is_rejected(qwen, write_card):
    qwen["run"] = "openrecipes train /tmp/tune/trials/003/recipe.yaml --nproc 1"
    qwen["notes"] += "\n- Measured from run directory /home/u/runs/cand (started 2026-12-01).\n"
    _, problems = validate_paths([write_card(qwen)], published=True)
    errors = {p.path: p for p in _errors(problems)}
    assert set(errors) == {"run", "notes"}
    assert "/tmp/tune/trials/003/recipe.yaml" in errors["run"].message and "run " in errors["run"].message
    assert "/home/u/runs/cand" in errors["notes"].message and "notes " in errors["notes"].message
    assert "relative to the repository" in errors["run"].message and errors["run"].line is not None


def test_urls_and_rates_are_no_paths(qwen, write_card):
    qwen["notes"] += ("\n- 6,913.2 tokens/s/GPU, $/1M tokens 0.32, 1/3 of the window; weights from "
                      "https://huggingface.co/Qwen/Qwen3-30B-A3B and hf://Qwen/Qwen3-30B-A3B, logs in s3://b/k.\n")
    _, problems = validate_paths([write_card(qwen)], published=True)
    assert [str(p) for p in problems if p.severity != "note"] == []


def test_outside_a_catalog_an_absolute_path_is_a_warning(qwen, write_card):
    qwen["workload"]["dataset"]["source"] = "/tmp/docs.jsonl"
    path = write_card(qwen)
    loaded, problems = validate_file(path)  # the old signature: where the file is decides
    assert loaded is not None and loaded.ok and _errors(problems) == []
    assert [(p.path, p.severity) for p in problems] == [("workload.dataset.source", "warning")]
    assert "warning: " in str(problems[0])
    assert _errors(validate_file(path, published=True)[1])[0].path == "workload.dataset.source"


def test_a_repository_catalog_is_published_and_a_tuner_output_is_not(qwen, tmp_path):
    qwen["run"] = "openrecipes train /tmp/x.yaml"
    repo = tmp_path / "clone"
    (repo / "recipes" / "m" / "gpu").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    published = repo / "recipes" / "m" / "gpu" / "card.yaml"
    tuner = repo / "tune-out" / "recipes" / "m" / "gpu" / "card.yaml"  # a recipes/ directory, not the catalog
    tuner.parent.mkdir(parents=True)
    for path in (published, tuner):
        path.write_text(yaml.safe_dump(qwen, sort_keys=False))
    assert is_catalog_path(published) and not is_catalog_path(tuner)
    assert [p.path for p in _errors(validate_file(published)[1])] == ["run"]
    assert _errors(validate_file(tuner)[1]) == []
    assert _validate(argparse.Namespace(paths=[tuner], quiet=True, published=None)) == 0
    assert _validate(argparse.Namespace(paths=[tuner], quiet=True, published=True)) == 1


def test_every_catalog_card_names_no_machine_path_and_validates():
    cards = find_card_files([CATALOG])
    assert TUNED_CARD in cards and len(cards) >= 3
    for card in cards:
        assert is_catalog_path(card), card
        assert absolute_paths(yaml.safe_load(card.read_text())) == [], card
        loaded, problems = validate_file(card)
        assert loaded is not None and _errors(problems) == [], [str(p) for p in problems]


def _trained_recipe(card: Path) -> Path:
    commands = [shlex.split(line, comments=True) for line in yaml.safe_load(card.read_text())["run"].splitlines()]
    [train] = [c for c in commands if c[:2] == ["openrecipes", "train"]]
    return REPO / train[2]


def test_the_tuned_cards_run_trains_a_recipe_of_the_catalog_that_builds_its_rows(tmp_path):
    from openrecipes.config.recipe import load_recipe
    from openrecipes.data.build import build_recipe_rows
    from openrecipes.data.manifest import read_manifest

    path = _trained_recipe(TUNED_CARD)
    assert path.is_file() and path.name.endswith(".recipe.yaml") and path.parent == TUNED_CARD.parent
    assert path not in find_card_files([CATALOG])  # a recipe, not a card
    recipe = load_recipe(path)
    card = yaml.safe_load(TUNED_CARD.read_text())
    lay, build = card["layout"], card["workload"]["dataset"]["build"]
    assert recipe.model_overrides == {"num_hidden_layers": 16} and recipe.global_batch == card["workload"]["global_batch"]
    assert (recipe.layout.max_tokens_per_gpu, recipe.layout.rows_per_microbatch, recipe.offload.fraction) == (
        lay["max_tokens_per_gpu"], lay["rows_per_microbatch"], 0.0)
    assert (recipe.recompute.method, recipe.recompute.num_layers) == (lay["recompute"]["method"],
                                                                      lay["recompute"]["num_layers"])
    assert recipe.steps == card["result"]["steps_per_run"] and recipe.data.rows is None
    # the generator the card's run names writes the input; the recipe's build makes the card's rows from it
    spec = importlib.util.spec_from_file_location("h200_rows", REPO / "bench" / "h200_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path / "in")
    assert recipe.data.build.input == "runs/h200-inputs/docs.jsonl"
    rows = build_recipe_rows(recipe.data.build.model_copy(update={"input": str(tmp_path / "in" / "docs.jsonl")}),
                             tmp_path / "rows")
    manifest = read_manifest(rows)
    assert manifest["rows_sha256"] == card["workload"]["dataset"]["rows_sha256"]
    assert (manifest["rows"], manifest["row_tokens"], manifest["seed"]) == (build["rows"], build["row_tokens"],
                                                                            build["seed"])


def test_card_new_writes_paths_under_the_working_directory_relative():
    tree = {"run": "openrecipes train /w/repo/runs/x/recipe.yaml --nproc 1",
            "notes": "- from run directory /w/repo/runs/x (started); rows /w/rows; https://h/w/repo/y",
            "list": ["/w/repo", "/w/repository/z"], "n": 3}
    assert relative_to(tree, "/w/repo") == {
        "run": "openrecipes train runs/x/recipe.yaml --nproc 1",
        # a one-folder relative path gets ./ so that it cannot read as a hub repository's org/name
        "notes": "- from run directory ./runs/x (started); rows /w/rows; https://h/w/repo/y",
        "list": [".", "/w/repository/z"], "n": 3}
    assert relative_to(tree, "/") == tree  # every path is under the root: nothing is rewritten


def test_a_card_that_must_hold_no_machine_path_names_each_by_its_last_part():
    tree = {"dataset": {"name": "/tmp/in/docs.jsonl", "source": "files: /data/a.jsonl, C:\\d\\b.jsonl; hf://x/y"},
            "tokenizer": "~/tok/qwen3/ (vocabulary 151669)", "n": 3}
    named = named_by_file(tree)
    assert not absolute_paths(named)
    assert named["dataset"]["name"] == "docs.jsonl (a path on the machine it ran on)"
    assert "a.jsonl (a path" in named["dataset"]["source"] and "b.jsonl (a path" in named["dataset"]["source"]
    assert named["dataset"]["source"].endswith("hf://x/y") and named["n"] == 3
    assert named["tokenizer"].startswith("qwen3 (a path on the machine it ran on)")
    nested = named_by_file("rows /w/rows from /w/rows/in.jsonl")
    assert nested == "rows rows (a path on the machine it ran on) from in.jsonl (a path on the machine it ran on)"
