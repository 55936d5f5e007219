"""A verified card holds only possible numbers: each impossible edit of a published card fails naming its field."""

from __future__ import annotations

import copy
import datetime
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from .card_fixtures import CATALOG, read_card_data

from openrecipes.cards import reference
from openrecipes.cards.validate import validate_paths
from openrecipes.cards.verification_load import load_verification_card

TUNED_CARD = CATALOG / "qwen3-30b-a3b" / "h200" / "qwen3-30b-a3b-16l-tune-start-tuned.yaml"
TINY_ITEMS = Path(__file__).resolve().parents[2] / "verification" / "qwen3-moe-tiny.yaml"
FUTURE = datetime.date.today() + datetime.timedelta(days=30)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        tree = tree[key]
    tree[last] = value


def _edits(*pairs: tuple[str, Any]) -> Callable[[dict[str, Any]], None]:
    def apply(card: dict[str, Any]) -> None:
        for dotted, value in pairs:
            _set(card, dotted, value)
    return apply


def _curve_point(arm: str, index: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def apply(card: dict[str, Any]) -> None:
        card["curves"][arm][index].update(fields)
    return apply


def _extra_curve_step(card: dict[str, Any]) -> None:
    card["curves"]["candidate"].append({"step": 50, "loss": 7.9})


def _step_time_and_throughput_apart(card: dict[str, Any]) -> None:
    # one row of 8,192 tokens x 2 rows in 0.6366 s is 25,737 tokens/s on one GPU, not ten times that
    card["curves"]["candidate"][6].update({"step_time_s": 0.6366, "tokens_per_s_per_gpu": 257370.0})


CARD_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("peak-override-1e30", _edits(("gpu.peak_bf16_dense_flops", 1e30), ("result.tokens_per_s_per_gpu", 1e9)),
     "gpu.peak_bf16_dense_flops"),
    ("peak-override-1e30-throughput", _edits(("gpu.peak_bf16_dense_flops", 1e30),
                                             ("result.tokens_per_s_per_gpu", 1e9)), "result.tokens_per_s_per_gpu"),
    ("cpu-at-1e12", _edits(("gpu.type", "cpu"), ("gpu.instance", None), ("result.tokens_per_s_per_gpu", 1e12)),
     "result.tokens_per_s_per_gpu"),
    ("negative-loss", _curve_point("candidate", 3, loss=-1.5), "curves.candidate[3].loss"),
    ("negative-reference-loss", _curve_point("reference", 0, loss=-0.1), "curves.reference[0].loss"),
    ("measured-in-the-future", _edits(("result.measured", FUTURE)), "result.measured"),
    ("measured-before-the-catalog", _edits(("result.measured", datetime.date(2001, 1, 1))), "result.measured"),
    ("component-test-in-the-future", lambda c: c["correctness"]["component_tests"][0].update(date=FUTURE),
     "correctness.component_tests[0].date"),
    ("zero-gpu-hours", _edits(("result.gpu_hours", 0.0)), "result.gpu_hours"),
    ("absurd-gpu-hours", _edits(("result.gpu_hours", 1e6)), "result.gpu_hours"),
    ("too-few-gpu-hours", _edits(("result.gpu_hours", 1e-5)), "result.gpu_hours"),
    ("convergence-over-more-steps", _edits(("correctness.convergence.steps", 1000)), "correctness.convergence.steps"),
    ("curve-past-the-run", _extra_curve_step, "curves.candidate[12].step"),
    ("absurd-peak-memory", _curve_point("candidate", 5, peak_memory_gib=5000.0), "curves.candidate[5].peak_memory_gib"),
    ("absurd-stage-memory", _curve_point("candidate", 5, peak_memory_gib_per_stage=[150.0]),
     "curves.candidate[5].peak_memory_gib_per_stage"),
    ("absurd-gpu-memory", _edits(("gpu.memory_gb", 1e6)), "gpu.memory_gb"),
    ("absurd-step-time-cv", _edits(("result.step_time_cv_percent", 1e6)), "result.step_time_cv_percent"),
    ("one-active-parameter", _edits(("result.active_params.count", 1)), "result.active_params.count"),
    ("hub-dataset-without-revision", _edits(("workload.dataset.source", "allenai/tulu-3-sft-mixture")),
     "workload.dataset.revision"),
    ("hub-checkpoint-without-revision", _edits(("result.active_params.source",
                                                "https://huggingface.co/Qwen/Qwen3-30B-A3B")),
     "result.active_params.revision"),
    ("step-time-against-throughput", _step_time_and_throughput_apart, "curves.candidate[6].tokens_per_s_per_gpu"),
]


def _error_paths(path: Path) -> list[str]:
    _, problems = validate_paths([path])
    return [p.path for p in problems if p.severity == "error"]


@pytest.mark.parametrize("case, edit, field", CARD_CASES, ids=[case for case, _, _ in CARD_CASES])
def test_an_impossible_edit_of_the_verified_h200_card_fails_naming_its_field(write_card, case, edit, field):
    card = copy.deepcopy(read_card_data(TUNED_CARD))
    assert card["status"] == "verified" and card["gpu"]["type"] == "H200"
    assert _error_paths(write_card(card, "unedited.yaml")) == []
    edit(card)
    assert field in _error_paths(write_card(card)), case


def test_a_stated_peak_may_exceed_the_tables_by_at_most_twice(write_card):
    card = copy.deepcopy(read_card_data(TUNED_CARD))
    card["result"]["mfu"] = None  # the stated MFU is against the table's peak
    table = reference.peak_flops("H200")
    card["gpu"]["peak_bf16_dense_flops"] = 1.5 * table
    assert "gpu.peak_bf16_dense_flops" not in _error_paths(write_card(card))
    card["gpu"]["peak_bf16_dense_flops"] = 2.5 * table
    assert "gpu.peak_bf16_dense_flops" in _error_paths(write_card(card))


def _tiny_sft_item(data: dict[str, Any]) -> dict[str, Any]:
    return data["items"][2]


def _cpu_at_1e15(item: dict[str, Any]) -> None:
    # a step time that makes the window's figures agree with each other: only the hardware rules it out
    met = item["metrics"]
    met["tokens_per_s_per_gpu"] = 1e15
    met["step_time_ms"] = met["window_tokens"] / 10 / 1e15 * 1000
    del met["model_tflops_per_gpu"]


def _negative_final_loss(item: dict[str, Any]) -> None:
    item["loss_curve"][-1]["loss"] = item["metrics"]["final_loss"] = -0.5


ITEM_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("cpu-at-1e15", _cpu_at_1e15, "items[2].metrics.tokens_per_s_per_gpu"),
    ("negative-curve-loss", lambda item: item["loss_curve"][4].update(loss=-2.0), "items[2].loss_curve[4].loss"),
    ("negative-final-loss", _negative_final_loss, "items[2].metrics.final_loss"),
    ("recorded-in-the-future", lambda item: item.update(recorded=FUTURE), "items[2].recorded"),
    ("hub-data-without-revision", lambda item: item["data"].update(source="allenai/tulu-3-sft-mixture"),
     "items[2].data.revision"),
    ("more-gpus-than-the-layout", lambda item: item["hardware"].update(count=64), "items[2].hardware.count"),
    ("more-memory-than-the-gpu", lambda item: (item["hardware"].update(type="H200"),
                                               item["metrics"].update(peak_memory_gib_per_stage=[500.0])),
     "items[2].metrics.peak_memory_gib_per_stage"),
]


@pytest.mark.parametrize("case, edit, field", ITEM_CASES, ids=[case for case, _, _ in ITEM_CASES])
def test_an_impossible_verification_item_fails_naming_its_field(tmp_path, case, edit, field):
    data = yaml.safe_load(TINY_ITEMS.read_text())
    data["items"] = [{k: v for k, v in item.items() if k != "recipe"} for item in data["items"][:3]]
    assert _tiny_sft_item(data)["status"] == "verified"
    path = tmp_path / "card.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_verification_card(path).ok
    edit(_tiny_sft_item(data))
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert field in [p.path for p in load_verification_card(path).problems if p.severity == "error"], case


def _with_window_step_times(card: dict[str, Any]) -> dict[str, Any]:
    """The card's candidate curve given step times over its window that give exactly its headline and spread."""
    result = card["result"]
    first, last = result["window"]
    n = last - first + 1
    mean = result["window_tokens"] / n / result["tokens_per_s_per_gpu"] / card["gpu"]["count"]
    ramp = [i - (n - 1) / 2 for i in range(n)]
    scale = (sum(r * r for r in ramp) / n) ** 0.5
    times = {first + i: mean * (1 + result["step_time_cv_percent"] / 100 * r / scale) for i, r in enumerate(ramp)}
    for point in card["curves"]["candidate"]:
        if point["step"] in times:
            point["step_time_s"] = times[point["step"]]
    return card


@pytest.mark.parametrize("field, factor", [("result.tokens_per_s_per_gpu", 1.5),
                                           ("result.step_time_cv_percent", 0.2)])
def test_the_headline_is_what_the_curves_step_times_give(write_card, field, factor):
    card = _with_window_step_times(copy.deepcopy(read_card_data(TUNED_CARD)))
    assert _error_paths(write_card(card, "consistent.yaml")) == []
    section, key = field.split(".")
    card[section][key] *= factor
    assert field in _error_paths(write_card(card)), field
