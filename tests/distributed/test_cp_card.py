"""A context-parallel run's card states what the loop ran: rows per microbatch count the cp factor."""

import json

import pytest

from openrecipes.cards.validate import load_card
from openrecipes.cli import main
from tests.distributed.test_layouts import metrics, train


def test_cp2_card_states_the_rows_per_microbatch_the_loop_ran(tmp_path):
    # 256-token rows at max_tokens_per_gpu=256: each of the two cp ranks holds 256 tokens of a 512-token microbatch
    common = ("layout.max_tokens_per_gpu=256", "steps=6")
    candidate, reference = tmp_path / "cp2", tmp_path / "ref"
    result = train(candidate, "layout.dp=1", "layout.cp=2", *common, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    result = train(reference, "layout.rows_per_microbatch=2", "layout.max_tokens_per_gpu=512", "steps=6")
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads((candidate / "run.json").read_text())
    assert run["rows_per_microbatch"] == 2 and run["row_tokens"] == 256
    # one process with two rows per microbatch takes the same steps, so the curves agree
    assert [r["loss"] for r in metrics(candidate)] == [
        pytest.approx(r["loss"], rel=1e-5) for r in metrics(reference)]

    out = tmp_path / "recipes" / "qwen3-moe-tiny" / "cpu" / "cp2.yaml"
    code = main(["card", "new", str(candidate), "--reference", str(reference), "--out", str(out),
                 "--author", "openrecipes tests", "--window", "1", "5", "--gpu-memory-gb", "16"])
    assert code == 0
    loaded = load_card(out)
    assert loaded.ok, [str(p) for p in loaded.problems]
    layout = loaded.card.layout
    assert layout.cp == 2 and layout.rows_per_microbatch == run["rows_per_microbatch"]
    assert "2 row(s) of 256 tokens per microbatch" in layout.summary
