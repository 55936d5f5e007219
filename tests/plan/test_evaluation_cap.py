"""A ranking evaluates at most MAX_PLAN_EVALUATIONS layout settings: past it, every setting of an evenly spaced sample
of the layouts, and the plan says how many it left out."""

from __future__ import annotations

import json
import time

import pytest

from openrecipes.cli import main
from openrecipes.plan import enumerate as plan_enumerate

SETTINGS = 3 * 2 * 3  # settings of one layout in plan's sweep: recompute x optimizer x offload_fraction


@pytest.fixture()
def small_cap(monkeypatch: pytest.MonkeyPatch) -> int:
    """A cap the tiny model's layouts exceed (it has 5,184 valid settings on a large fleet), so the test is quick."""
    monkeypatch.setattr(plan_enumerate, "MAX_PLAN_EVALUATIONS", 300)
    return 300


def test_a_large_fleet_is_cut_at_the_cap_and_the_plan_says_so(small_cap, capsys):
    started = time.monotonic()
    assert main(["plan", "qwen3-moe-tiny", "--gpus", "55440xH200", "--json"]) == 0  # 120 divisors
    assert time.monotonic() - started < 30
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] > small_cap and out["evaluated"] == small_cap // SETTINGS * SETTINGS
    assert out["capped"].startswith(f"evaluated {out['evaluated']:,} of {out['valid']:,} valid layout settings "
                                    f"(MAX_PLAN_EVALUATIONS = {small_cap}")
    assert out["fitting"] > 0 and out["ranked"]
    assert main(["plan", "qwen3-moe-tiny", "--gpus", "55440xH200"]) == 0
    assert "MAX_PLAN_EVALUATIONS = 300" in capsys.readouterr().out


def test_the_sample_spans_every_layout_family_and_every_setting(small_cap):
    from openrecipes.config.layout import LayoutConfig

    layouts = [LayoutConfig(dp=1, max_tokens_per_gpu=4096 * (1 + i)) for i in range(1000)]
    sampled = plan_enumerate._sampled(layouts, SETTINGS)
    assert len(sampled) == small_cap // SETTINGS
    assert sampled[0] is layouts[0] and sampled[-1].max_tokens_per_gpu > 4096 * 900  # from the whole list
    assert plan_enumerate._sampled(layouts[:10], SETTINGS) == layouts[:10]  # under the cap: all of them


def test_an_ordinary_fleet_is_ranked_in_full(capsys):
    assert main(["plan", "qwen3-moe-tiny", "--gpus", "8xH200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["evaluated"] == out["valid"] and out["capped"] is None
