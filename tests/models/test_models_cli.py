"""`openrecipes models`: the total counts every parameter, the frozen expert bias included."""

import json

from openrecipes.cli import main
from openrecipes.models.cli import rows
from openrecipes.models.families import family_for_config
from openrecipes.models.registry import get_config


def test_total_includes_the_frozen_expert_bias():
    by_name = {row["name"]: row for row in rows()}
    full = by_name["muse-spark-open-816b-a42b"]
    assert full["frozen_params"] == 62 * 256
    assert full["total_params"] == full["trainable_params"] + 62 * 256
    assert full["trainable_params"] == get_config("muse-spark-open-816b-a42b").total_params()
    assert by_name["qwen3-30b-a3b"]["frozen_params"] == 0
    for name in ("muse-spark-tiny", "qwen3-moe-tiny", "glm4-moe-tiny"):  # against the built module, every parameter counted
        config = get_config(name)
        model = family_for_config(config).build(config, device="meta", seed=None)
        assert by_name[name]["total_params"] == sum(p.numel() for p in model.parameters()), name
        assert by_name[name]["frozen_params"] == sum(p.numel() for p in model.parameters() if not p.requires_grad)


def test_table_and_json_show_the_total(capsys):
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "frozen" in table.splitlines()[0]
    full = get_config("muse-spark-open-816b-a42b")
    assert f"{full.total_params() + 62 * 256:,}" in table
    assert main(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["total_params"] > 0
