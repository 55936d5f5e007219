"""`plan` beside a published card is like for like: the card's exact recipe (its layout and every setting the planner
models) predicted against what it measured; and a ranked layout this engine never ran on GPUs is flagged."""

import json
from pathlib import Path

import yaml

from openrecipes.cli import main
from openrecipes.config.layout import LayoutConfig
from openrecipes.models.registry import get_config
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.gpu_runs import engine_gpu_runs
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.memory import TrainingSetup
from openrecipes.plan.published import compare_card, exact_recipe, published_cards
from openrecipes.plan.shape import model_shape

REPO = Path(__file__).resolve().parents[2]
CATALOG, RESULTS = REPO / "recipes", REPO / "bench" / "results"
QWEN = CATALOG / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.yaml"
MUSE = CATALOG / "muse-spark-open" / "h200" / "attune-tp4-pp16-ep8.yaml"
TUNED = CATALOG / "qwen3-30b-a3b" / "h200" / "qwen3-30b-a3b-16l-tune-start-tuned.yaml"
QWEN_ARGS = ["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--max-tokens-per-gpu", "16384", "--recompute", "full",
             "--optimizer", "precision-aware", "--offload-fraction", "0", "--top", "3"]


def _layout(**sizes) -> LayoutConfig:
    return LayoutConfig(max_tokens_per_gpu=8192, **sizes)


def test_the_cards_exact_settings_are_read_not_only_its_layout():
    qwen_layout, qwen = exact_recipe(yaml.safe_load(QWEN.read_text()), "megatron")
    assert (qwen_layout.ep, qwen_layout.dp, qwen_layout.max_tokens_per_gpu, qwen_layout.rows_per_microbatch) \
        == (8, 8, 16384, 2)
    assert qwen == {"recompute": "full", "recompute_layers": None, "optimizer": "precision-aware",
                    "offload_fraction": 0.0, "offload_update": "host", "global_batch_tokens": 128 * 8192,
                    "engine": "megatron"}
    muse_layout, muse = exact_recipe(yaml.safe_load(MUSE.read_text()), "megatron")
    assert (muse_layout.tp, muse_layout.pp, muse_layout.pp_first_stage_layers, muse_layout.pp_last_stage_layers,
            muse_layout.sequence_parallel) == (4, 16, 3, 3, True)
    assert muse["offload_fraction"] == 0.3 and muse["optimizer"] == "precision-aware"
    # this engine's card: the optimizer and the offload update from the recipe file its run trains, block
    # recompute's layers
    _, tuned = exact_recipe(yaml.safe_load(TUNED.read_text()), "openrecipes", TUNED)
    assert tuned["recompute_layers"] == 8 and tuned["engine"] == "openrecipes"
    assert tuned["optimizer"] == "precision-aware" and tuned["offload_update"] == "device"


def test_a_card_is_compared_with_its_exact_recipe_predicted_and_the_error_shown():
    shape, hw = model_shape(get_config("qwen3-30b-a3b"), name="qwen3-30b-a3b"), load_hardware("H200")
    [card] = published_cards(CATALOG, "qwen3-30b-a3b", "H200", 8)
    layout = LayoutConfig(ep=8, dp=8, max_tokens_per_gpu=16384, rows_per_microbatch=2)
    by_hand = evaluate(shape, layout, TrainingSetup(recompute="full", optimizer="precision-aware", engine="megatron",
                                                    global_batch_tokens=128 * 8192), hw)
    # a ranking whose first layout is the card's, with other settings: its rank is not its exact prediction
    other = evaluate(shape, layout.model_copy(update={"max_tokens_per_gpu": 4096, "rows_per_microbatch": None}),
                     TrainingSetup(recompute="none", optimizer="adam", engine="openrecipes"), hw)
    out = compare_card(card, [other], hw, shape)
    predicted = by_hand.throughput.tokens_per_s_per_gpu
    error = predicted / 6913.23 - 1
    assert out["exact_recipe"]["predicted_tokens_per_s_per_gpu"] == round(predicted, 1)
    assert out["exact_recipe"]["error"] == round(error, 4) and out["exact_recipe"]["engine"] == "megatron"
    assert abs(predicted - other.throughput.tokens_per_s_per_gpu) > 100  # the two really differ
    assert (f"its exact recipe (TP1 PP1 EP8 DP8, 16,384 tokens/GPU, recompute full, precision-aware, offload 0, "
            f"generic model) predicts {predicted:,.0f} tokens/s/GPU: {error:+.1%} against measured") in out["why"]
    assert f"ranks #1 of 1 here at {other.throughput.tokens_per_s_per_gpu:,.0f} predicted, with the ranking's " \
           "settings (4,096 tokens/GPU, recompute none, adam" in out["why"]
    assert "the top layout" not in out["why"]  # it is the card's layout


def test_layouts_this_engine_ran_on_gpus_come_from_bench_results_and_its_own_cards(tmp_path):
    runs = engine_gpu_runs(RESULTS, CATALOG)
    assert runs.ran(_layout(ep=4, dp=4)) and runs.ran(_layout(tp=2, ep=4, dp=2, sequence_parallel=True))
    assert runs.ran(_layout())  # the tuned 16-layer card ran TP1 PP1 EP1 DP1 on an H200
    assert not runs.ran(_layout(tp=2, pp=32, ep=4, dp=2, sequence_parallel=True))  # no pipeline ever ran
    assert not runs.ran(_layout(ep=8, dp=8))  # the seed card's layout ran with Megatron-LM, not here
    # a card of another framework or one measured on a CPU adds nothing; this engine's GPU card adds its layout
    cards = tmp_path / "recipes" / "m" / "h200"
    cards.mkdir(parents=True)
    for name, framework, gpu in (("ours", "openrecipes 0.1.0", "H200"), ("cpu", "openrecipes 0.1.0", "cpu"),
                                 ("theirs", "miles 0.1.0", "H200")):
        (cards / f"{name}.yaml").write_text(yaml.safe_dump({
            "stack": {"framework": framework}, "gpu": {"type": gpu},
            "layout": {"tp": 1, "pp": 2 if name == "ours" else 4, "ep": 1, "dp": 1}}))
    mine = engine_gpu_runs(tmp_path / "absent", tmp_path / "recipes")
    assert mine.ran(_layout(pp=2)) and not mine.ran(_layout(pp=4)) and len(mine.layouts) == 1


def test_the_ranking_flags_layouts_not_run_on_gpus_and_prints_the_exact_comparison(capsys, tmp_path):
    assert main(QWEN_ARGS + ["--recipes", str(CATALOG), "--bench-results", str(RESULTS), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = engine_gpu_runs(RESULTS, CATALOG)
    assert [r["run_on_gpus_by_this_engine"] for r in out["ranked"]] == [
        runs.ran(LayoutConfig(**r["layout"]))
        for r in out["ranked"]]
    [card] = out["published_cards"]
    assert card["exact_recipe"]["engine"] == "megatron" and card["layout_rank"] >= 1
    assert main(QWEN_ARGS + ["--recipes", str(CATALOG), "--bench-results", str(RESULTS)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[2].split()[-1] == "GPUs" and all(line.split()[-1] in ("run", "never") for line in lines[3:6])
    assert "'never' marks a layout not run on GPUs by this engine" in text
    assert "its exact recipe (TP1 PP1 EP8 DP8, 16,384 tokens/GPU" in text and "against measured" in text
    # no record of this engine's runs: nothing is claimed either way
    assert main(QWEN_ARGS + ["--recipes", str(tmp_path), "--bench-results", str(tmp_path / "absent")]) == 0
    text = capsys.readouterr().out
    assert "no record of this engine's GPU runs" in text and " never" not in text
