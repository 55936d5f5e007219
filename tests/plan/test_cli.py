import json
import re

import pytest

from openrecipes.cli import main

MUSE_ARGS = ["plan", "muse-spark-open-816b-a42b", "--gpus", "128xH200", "--tp", "4", "--pp", "16",
             "--pp-first-stage-layers", "3", "--pp-last-stage-layers", "3", "--ep", "8", "--dp", "2",
             "--sequence-parallel", "--max-tokens-per-gpu", "8192", "--optimizer", "precision-aware"]


def test_json_output_for_one_layout(capsys):
    assert main(MUSE_ARGS + ["--recompute", "full", "--offload-fraction", "0.3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("fits", "peak_memory_gib", "per_stage_memory_gib", "predicted_tokens_per_s_per_gpu",
                "predicted_mfu"):
        assert key in out
    assert out["fits"] is True and len(out["per_stage_memory_gib"]) == 16
    assert out["peak_memory_gib"] == max(out["per_stage_memory_gib"])


def test_recompute_none_whole_optimizer_on_cpu_does_not_fit(capsys):
    assert main(MUSE_ARGS + ["--recompute", "none", "--offload-fraction", "1.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_gpu_memory_override_changes_the_verdict(capsys):
    assert main(MUSE_ARGS + ["--recompute", "full", "--gpu-memory-gib", "40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_enumeration_prints_a_ranked_table(capsys):
    assert main(["plan", "qwen3-moe-tiny", "--gpus", "8xH100", "--max-tokens-per-gpu", "4096",
                 "--recompute", "full", "--optimizer", "adam", "--offload-fraction", "0", "--top", "3",
                 "--usd-per-gpu-hour", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "fit" in lines[0] and "at 3 USD/GPU-hour" in lines[1] and len(lines) == 3 + 3 + 2
    assert all(line.split()[-2] in ("openrecipes", "generic") and line.split()[-1] in ("run", "never", "?")
               and "$" in line for line in lines[3:6])
    assert lines[6].startswith("on GPUs")
    # how far this engine's predictions were from the runs it was not fitted on, with how many runs and which GPU
    assert re.fullmatch(r"prediction error of this engine's tokens/s/GPU \(bench/plan_calibration.py\): within "
                        r"\d+\.\d% \(median \d+\.\d%\) on \d+ held-out H200 runs \(and 3 it was fitted on\); .*",
                        lines[7]), lines[7]


def test_every_gpu_of_the_planner_has_a_price_or_says_how_to_give_one(capsys):
    from openrecipes.config.hardware import load_hardware

    args = ["plan", "qwen3-30b-a3b", "--gpus", "8xH100", "--ep", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rate = load_hardware().instance("AWS p5.48xlarge").usd_per_gpu_hour
    assert f"$/1M tokens at {rate:g} USD/GPU-hour (default instance AWS p5.48xlarge of H100): $" in out
    tokens = re.search(r"predicted ([\d,]+\.\d) tokens/s/GPU", out).group(1)
    assert "," in tokens and float(tokens.replace(",", "")) >= 1000  # thousands separated, as every other command
    assert main(["plan", "qwen3-30b-a3b", "--gpus", "8xB200", "--ep", "8"]) == 0
    assert ("$/1M tokens: no public price of B200 in config/hardware.yaml: give --usd-per-gpu-hour P (or --instance "
            "NAME)\n") in capsys.readouterr().out
    assert main(["plan", "qwen3-30b-a3b", "--gpus", "8xH100", "--ep", "8", "--bench-results", "/nonexistent"]) == 0
    assert "prediction error: unknown, no measured GPU run of this engine under /nonexistent" in capsys.readouterr().out


def test_bad_layout_is_a_user_error(capsys):
    assert main(["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--tp", "3"]) == 2
    assert "--dp" in capsys.readouterr().err
    assert main(["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--ep", "3"]) == 2
    assert "ep" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--tp", "0"], ["--pp", "0"], ["--cp", "0"], ["--ep", "0"], ["--dp", "0"],
                                   ["--max-tokens-per-gpu", "-5"], ["--rows-per-microbatch", "0"],
                                   ["--pp", "2", "--pp-first-stage-layers", "0"]])
def test_a_size_below_one_is_one_line_naming_its_flag(capsys, flags):
    assert main(["plan", "qwen3-moe-tiny", "--gpus", "8xH100", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"openrecipes plan: error: {flags[-2]}: must be at least 1, got {flags[-1]}"], err


def test_rows_per_microbatch_plans_that_one_layout(capsys):
    """A layout's own field: given alone it plans one layout with it, not a ranking that ignores it."""
    assert main(["plan", "qwen3-moe-tiny", "--gpus", "8xH100", "--rows-per-microbatch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "ranked" not in out and out["layout"]["rows_per_microbatch"] == 2


def test_default_engine_is_this_one_where_it_runs_the_layout_else_the_generic_model_said(capsys):
    base = ["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--max-tokens-per-gpu", "16384"]
    assert main(base + ["--ep", "8", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert ours["engine"] == "openrecipes" and ours["openrecipes_runs_it"] is True
    assert main(base + ["--tp", "2"]) == 0  # tp without sequence parallelism: not run by this engine
    out = capsys.readouterr().out
    assert "engine: the generic model" in out and "sequence_parallel" in out
    assert main(base + ["--ep", "8", "--engine", "megatron", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "megatron"


def test_price_per_million_tokens_from_the_hardware_table_or_given(capsys):
    from openrecipes.config.hardware import load_hardware

    base = ["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--ep", "8", "--json"]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    rate = load_hardware().instance("AWS p5en.48xlarge").usd_per_gpu_hour
    assert out["usd_per_gpu_hour"] == rate and "default instance" in out["price_source"]
    assert out["usd_per_million_tokens"] == round(rate / (out["predicted_tokens_per_s_per_gpu"] * 3600) * 1e6, 4)
    assert main(base + ["--usd-per-gpu-hour", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["usd_per_gpu_hour"] == 2


def test_ranking_far_from_a_published_card_says_why(capsys, tmp_path):
    from pathlib import Path

    catalog = Path(__file__).resolve().parents[2] / "recipes"
    args = ["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--max-tokens-per-gpu", "16384", "--recompute", "full",
            "--optimizer", "precision-aware", "--offload-fraction", "0", "--top", "1"]
    assert main(args + ["--recipes", str(catalog)]) == 0
    out = capsys.readouterr().out
    assert "attune-tp1-pp1-ep8-mt16k.yaml" in out and "ranks #" in out
    assert "balanced routing" in out and "efficiencies" in out
    assert main(args + ["--recipes", str(tmp_path)]) == 0  # no card for it: nothing said
    assert "published card" not in capsys.readouterr().out


def test_unknown_gpu_suggests_the_closest(capsys):
    assert main(["plan", "qwen3-30b-a3b", "--gpus", "8xH20"]) == 2
    assert "did you mean H200?" in capsys.readouterr().err


def test_lora_flags_plan_adapters_on_a_frozen_base(capsys):
    args = ["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--ep", "8", "--dp", "8", "--recompute", "full", "--json"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)["peak_memory_gib"]
    assert main(args + ["--lora-rank", "16", "--lora-targets", "q_proj,v_proj,experts"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_memory_gib"] < full
    assert main(args + ["--lora-rank", "16", "--lora-targets", "q_proj,gate"]) == 2
    assert "lora.targets: unknown target(s) ['gate']" in capsys.readouterr().err


def test_offload_update_is_the_recipes_default_for_this_engine(capsys):
    # this engine's plan updates offloaded state where a recipe does by default (config/recipe.py Offload.update, the
    # device: no host gradient copies); Megatron-LM's on the CPU, reading host copies of the gradients
    from openrecipes.config.recipe import Offload

    default = Offload.model_fields["update"].default
    one = ["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--ep", "8", "--offload-fraction", "0.5"]
    for engine, update in (("openrecipes", default), ("megatron", "host")):
        assert main(one + ["--engine", engine, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["offload_update"] == update, engine
        assert (out["host_parts_gib"][0]["gradient_copies"] > 0) == (update == "host"), engine
    assert main(["plan", "qwen3-moe-tiny", "--gpus", "2xH200", "--offload-fraction", "0.5", "--optimizer", "adam",
                 "--recompute", "full", "--max-tokens-per-gpu", "4096", "--engine", "openrecipes", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(plan["offload_update"] == default for plan in ranked)


def test_each_ranked_prediction_carries_its_measured_error(capsys):
    # this engine's rows carry the worst held-out error of its H200 runs; the generic model's and another GPU's "?"
    from openrecipes.plan.calibration import speed_error

    h200 = speed_error("bench/results", "H200")
    assert h200 is not None and speed_error("bench/results", "B200") is None
    args = ["--max-tokens-per-gpu", "4096", "--recompute", "full", "--optimizer", "adam", "--offload-fraction", "0",
            "--top", "3", "--usd-per-gpu-hour", "3"]
    for gpus, expected in (("8xH200", f"±{h200:.0%}"), ("8xB200", "?")):
        assert main(["plan", "qwen3-moe-tiny", "--gpus", gpus, *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "tok/s/GPU  error" in lines[2]
        rows = [line.split() for line in lines[3:6]]  # ... tokens/s, error, MFU, $/1M tokens, engine, on GPUs
        assert [row[-5] if row[-2] == "openrecipes" else expected for row in rows] == [expected] * 3, lines
