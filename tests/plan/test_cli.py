import json

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
                 "--recompute", "full", "--optimizer", "adam", "--offload-fraction", "0", "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "fit" in lines[0] and len(lines) == 2 + 3


def test_bad_layout_is_a_user_error(capsys):
    assert main(["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--tp", "3"]) == 2
    assert "--dp" in capsys.readouterr().err
    assert main(["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--ep", "3"]) == 2
    assert "ep" in capsys.readouterr().err


def test_lora_flags_plan_adapters_on_a_frozen_base(capsys):
    args = ["plan", "qwen3-30b-a3b", "--gpus", "8xH200", "--ep", "8", "--dp", "8", "--recompute", "full", "--json"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)["peak_memory_gib"]
    assert main(args + ["--lora-rank", "16", "--lora-targets", "q_proj,v_proj,experts"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_memory_gib"] < full
    assert main(args + ["--lora-rank", "16", "--lora-targets", "q_proj,gate"]) == 2
    assert "lora.targets: unknown target(s) ['gate']" in capsys.readouterr().err
