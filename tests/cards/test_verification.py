"""Verification cards: the committed ones load, and a card whose numbers do not follow from its run is rejected."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from openrecipes.cards.verification_load import load_verification_card, validate_any
from openrecipes.cli import main

REPO = Path(__file__).resolve().parents[2]
VERIFICATION = REPO / "verification"
QWEN = VERIFICATION / "qwen3-moe-tiny.yaml"
MUSE = VERIFICATION / "muse-spark-open-816b-a42b.yaml"


def test_committed_cards_and_the_seed_rule():
    qwen = load_verification_card(QWEN)
    assert qwen.ok, [str(p) for p in qwen.problems]
    assert {item.workflow for item in qwen.card.items} >= {"import", "export", "sft", "pretrain", "lora"}
    assert all(item.status == "verified" for item in qwen.card.items)
    muse = load_verification_card(MUSE)
    verified = [i for i, item in enumerate(muse.card.items) if item.status == "verified"]
    assert len(verified) == 6 and muse.card.engine == "Megatron Bridge"
    # the seed's verified items ran on an unpinned revision: exactly those are rejected, for exactly that
    errors = [p for p in muse.problems if p.severity == "error"]
    assert sorted(p.path for p in errors) == sorted(f"items[{i}].checkpoint.revision" for i in verified)
    assert all("not pinned" in p.message for p in errors)
    files, problems = validate_any([VERIFICATION, REPO / "recipes"])
    cards = [p for p in (REPO / "recipes").rglob("*.yaml") if not p.name.endswith(".recipe.yaml")]  # recipes skipped
    assert files == len(list(VERIFICATION.glob("*.yaml"))) + len(cards)
    assert {p.file for p in problems if p.severity == "error"} == {str(MUSE)}


def _bad(data: dict, case: str) -> str:
    item = data["items"][2]  # the SFT item
    met = item["metrics"]
    if case == "unpinned":
        item["checkpoint"] = {"source": "Qwen/Qwen3-30B-A3B", "revision": "main"}
        return "items[2].checkpoint.revision"
    if case == "generated-without-hash":
        del item["checkpoint"]["sha256"]
        return "items[2].checkpoint.sha256"
    if case == "generated-from-an-unpinned-hub-model":
        item["checkpoint"]["source"] = "Qwen/Qwen3-30B-A3B fine-tuned by this run"
        return "items[2].checkpoint.revision"
    if case == "final-loss":
        met["final_loss"] += 0.01
        return "items[2].metrics.final_loss"
    if case == "throughput":
        met["tokens_per_s_per_gpu"] = round(met["tokens_per_s_per_gpu"] * 1.1, 3)
        return "items[2].metrics.tokens_per_s_per_gpu"
    if case == "tflops-below-dense":
        met["model_tflops_per_gpu"] = met["model_tflops_per_gpu"] / 2
        return "items[2].metrics.model_tflops_per_gpu"
    if case == "window":
        met["window"] = [met["window"][0] - 1, met["window"][1] - 1]
        return "items[2].metrics.window"
    if case == "nan-under-verified":
        item["loss_curve"] = item["loss_curve"][:-1]
        met["final_loss"] = item["loss_curve"][-1]["loss"]
        met["nan_steps"] = met["skipped_steps"] = 1
        return "items[2].metrics.nan_steps"
    if case == "stage-count":
        met["peak_memory_gib_per_stage"] = [1.0, 2.0]
        return "items[2].metrics.peak_memory_gib_per_stage"
    if case == "duplicate":
        data["items"].append(copy.deepcopy(item))
        return f"items[{len(data['items']) - 1}]"
    raise AssertionError(case)


CASES = ["unpinned", "generated-without-hash", "generated-from-an-unpinned-hub-model", "final-loss", "throughput", "tflops-below-dense", "window",
         "nan-under-verified", "stage-count", "duplicate"]


def test_rejected_items(tmp_path):
    original = yaml.safe_load(QWEN.read_text())
    # the first three items (import, export, SFT) without their recipe texts keep each case small and quick
    original["items"] = [{k: v for k, v in item.items() if k != "recipe"} for item in original["items"][:3]]
    for case in CASES:
        data = copy.deepcopy(original)
        where = _bad(data, case)
        path = tmp_path / f"{case}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        loaded = load_verification_card(path)
        paths = {p.path for p in loaded.problems if p.severity == "error"}
        assert where in paths, (case, [str(p) for p in loaded.problems])
    assert main(["card", "validate", "--quiet", str(path)]) == 1  # and the command line says so (the last case)


def test_schema_file_is_current_and_unknown_fields_name_their_line(tmp_path, capsys):
    assert main(["card", "schema", "--kind", "verification", "--out", str(REPO / "schema" / "verification.schema.json"),
                 "--check"]) == 0
    text = QWEN.read_text().replace("  observed:", "  observd:", 1)
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    assert main(["card", "validate", str(path)]) == 1
    line = next(n for n, t in enumerate(text.splitlines(), 1) if "observd:" in t)
    assert f"{path}:{line}: items[0].observd: unknown field" in capsys.readouterr().err


def test_hostile_yaml_is_refused_by_the_same_loader(tmp_path, capsys):
    text = QWEN.read_text().replace("  hardware:\n", "  hardware: &hw\n", 1)
    path = tmp_path / "anchor.yaml"
    path.write_text(text + "extra: *hw\n")
    assert main(["card", "validate", str(path)]) == 1
    assert "anchor '&hw' is not allowed" in capsys.readouterr().err


def test_a_workflow_that_is_not_the_runs_says_what_long_context_sft_is():
    from openrecipes.cards.verify_item import _check_workflow

    with pytest.raises(ValueError, match=r"--workflow long-context-sft, but run trained sft .*cp > 1, or rows of at "
                                         r"least [\d,]+ tokens"):
        _check_workflow("long-context-sft", "sft", 1, Path("run"))
