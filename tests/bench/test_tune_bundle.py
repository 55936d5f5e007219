"""bench/tune_bundle.py: one results file from a tuner's --out directory (its log, trials, prunes, settings,
calibration, the card and not the card's recipe, the tuned recipe)."""

import json

from .conftest import load_bench

tune_bundle = load_bench("tune_bundle")


def test_a_tune_output_becomes_one_record(tmp_path):
    out = tmp_path / "tune"
    cards = out / "recipes" / "gpt-oss-20b" / "h100"
    cards.mkdir(parents=True)
    (cards / "start-tuned.yaml").write_text("status: verified\n")
    (cards / "start-tuned.recipe.yaml").write_text("name: start-tuned\n")
    (out / "tune.json").write_text(json.dumps({"result": {"outcome": "tuned"}}))
    (out / "trials.jsonl").write_text('{"index": 0}\n\n{"index": 1}\n')
    (out / "tuned.yaml").write_text("name: start-tuned\n")
    log = tmp_path / "tune.log"
    log.write_text("[tune] tuning start.yaml\n")
    record = tune_bundle.bundle(out, start="start.yaml", command="openrecipes tune start.yaml", log=log)
    assert record["tune"] == {"result": {"outcome": "tuned"}} and [t["index"] for t in record["trials"]] == [0, 1]
    assert record["card"] == "status: verified\n" and record["tuned_recipe"] == "name: start-tuned\n"
    assert record["pruned"] == [] and record["calibration"] is None and record["log"].startswith("[tune]")
    assert record["benchmark"] == "tune" and record["start"] == "start.yaml"
