"""The transformers peer of gpt-oss, GLM-4.5-MoE and Qwen3.5-MoE (bench/hf_families.py): at the workloads' real widths
it builds the engine's model (same parameter count, on the meta device); at tiny widths on the CPU it trains with finite
losses, --balanced gives every expert the same load, --lora trains exactly the adapters the engine's apply_lora adds;
the schema pairs each workload with its family's peer, and the runner runs one beside the engine."""

import json
import math

import pytest
import torch
from pydantic import ValidationError

from .conftest import BENCH, load_bench, run_workload

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
peer = load_bench("hf_families")
workloads = load_bench("workloads")

TINY = {"gpt_oss": "gpt-oss-20b", "glm4_moe": "glm-4.5-air", "qwen3_5_moe": "qwen3.5-moe-tiny"}
NEW = ["gptoss_bal_c", "gptoss_bal_c_none", "glm45_bal_c", "glm45_bal_c_none", "qwen35_bal_c", "qwen35_bal_c_none",
       "gptoss20b_lora_c"]


def engine_model(config, lora: bool):
    """The engine's model of ``config`` (its family's build), adapted by its apply_lora with the workloads' LoRA."""
    from openrecipes.models.common.lora import LoraSpec, apply_lora
    from openrecipes.models.registry import families

    family = next(f for f in families() if isinstance(config, f.config_class))
    model = family.build(config, device="cpu", dtype=torch.bfloat16, seed=0)
    if lora:
        spec = workloads.LORA
        apply_lora(model, LoraSpec(rank=spec["rank"], alpha=spec["alpha"], dropout=spec["dropout"],
                                   targets=tuple(spec["targets"])))
    return model


def trained_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", NEW)
def test_the_peer_builds_the_engine_model_of_each_workload_at_real_widths(name):
    spec = workloads.load_workloads()[name].engine_spec()
    command = load_bench("run").peer_command(workloads.load_workloads()[name], BENCH / "x.json", None, tiny=False)
    args = peer.parse_args(command[2:])  # what the runner tells the peer
    if "overrides" in spec:
        assert json.loads(args.overrides) == spec["overrides"] and "--layers" not in command
    config = peer.model_config(args)
    family = peer.FAMILIES[args.family]
    hf = peer.build_model(family, config, torch.device("meta"), family.attention, "grouped_mm")
    assert type(hf).__name__ == family.model_class and args.row_tokens == spec["row_tokens"] == 4096
    assert sum(p.numel() for p in hf.parameters()) == config.total_params()
    assert len(hf.model.layers) == config.num_hidden_layers == (24 if name == "gptoss20b_lora_c" else 4)


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.parametrize("flags", [["--balanced"], ["--lora", "--balanced", "--no-recompute"]], ids=["bal", "lora"])
def test_the_peer_trains_the_tiny_model_on_cpu(family, flags, monkeypatch):
    router = getattr(peer.modeling(peer.FAMILIES[family]), peer.FAMILIES[family].router)
    monkeypatch.setattr(router, "forward", router.forward)  # --balanced patches the class: undone after the test
    torch.set_num_threads(1)
    args = peer.parse_args(["--model", TINY[family], "--tiny", "--device", "cpu", "--steps", "3", "--window", "1,1",
                            *flags])
    result = peer.run(args)
    config = peer.model_config(args)
    lora = "--lora" in flags
    assert result["family"] == family and result["model"] == peer.FAMILIES[family].tiny
    assert result["total_params"] == trained_count(engine_model(config, lora=False)) == config.total_params()
    assert result["same_params_as_engine"] is True and result["grad_ckpt"] is not lora
    assert len(result["losses"]) == 3 and all(math.isfinite(x) and x > 0 for x in result["losses"])
    moe_layers = sum(hasattr(layer.mlp, "experts") for layer in
                     peer.build_model(peer.FAMILIES[family], config, torch.device("meta"), "eager", "grouped_mm")
                     .model.layers)
    assert result["load_max_over_mean"] == result["load_min_over_mean"] == [1.0] * moe_layers
    assert result["routing"].startswith("forced") and result["experts_implementation"] == "grouped_mm"
    assert result["attn_implementation"] == ("eager" if family == "gpt_oss" else "sdpa")
    assert ("linear_attention" in result) is (family == "qwen3_5_moe")
    if lora:
        assert result["trainable_params"] == trained_count(engine_model(config, lora=True)) > 0
        assert "peft" in result["framework"]


@pytest.mark.parametrize("entry", [
    {"peer": {"harness": "transformers_gpt_oss"}},  # the default model is Qwen3
    {"peer": {"harness": "transformers_glm4_moe"}, "model": "gpt-oss-20b", "tiny_model": "gpt-oss-tiny"},
    {"peer": {"harness": "transformers_gpt_oss"}, "model": "gpt-oss-20b"},  # the tiny model defaults to Qwen3's
    {"peer": {"harness": "transformers_gpt_oss"}, "model": "gpt-oss-20b", "tiny_model": "gpt-oss-tiny",
     "lora": True},
    {"peer": {"harness": "transformers_peft_gpt_oss"}, "model": "gpt-oss-20b", "tiny_model": "gpt-oss-tiny"},
    {"peer": {"harness": "transformers_qwen3_moe"}, "model": "qwen3-moe-tiny"},  # that peer trains Qwen3-30B-A3B
], ids=["default_model", "other_family", "tiny_of_other_family", "lora_without_peft", "peft_without_lora",
        "qwen3_peer_other_model"])
def test_the_schema_pairs_a_workload_with_its_family_peer(entry):
    with pytest.raises(ValidationError):
        workloads.Workload.model_validate(entry)


def test_the_runner_runs_a_family_workload_beside_its_peer(tmp_path):
    engine, hf = run_workload("glm45_bal_c_none", tmp_path / "results.json")["samples"]
    assert engine["record"]["trained_model"] == hf["record"]["model"] == "glm4-moe-tiny"
    assert engine["tokens_per_s_per_gpu"] > 0 and hf["tokens_per_s_per_gpu"] > 0
    assert "--no-recompute" in hf["command"] and hf["record"]["grad_ckpt"] is False
    assert len(engine["record"]["step_times_s"]) == len(hf["record"]["step_times_s"]) == 7
