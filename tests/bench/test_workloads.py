"""bench/workloads.yaml: every entry validates, the engine reads its workloads from it, and the schema refuses what
a peer cannot run and what is misspelt."""

import pytest
import yaml
from pydantic import ValidationError

from .conftest import BENCH, load_bench

workloads = load_bench("workloads")


def test_every_declared_workload_validates_and_the_engine_reads_them_from_the_file():
    declared = workloads.read_workload_file()
    assert len(declared.workloads) > 10
    engine_speed = load_bench("engine_speed")
    assert engine_speed.VARIANTS == {name: w.engine_spec() for name, w in declared.workloads.items()}
    assert set(engine_speed.PROFILED) == {name for name, w in declared.workloads.items() if w.profile}
    for spec in engine_speed.VARIANTS.values():  # what run_variant reads without a default
        assert {"packed", "rows_per_step", "balanced"} <= set(spec)


def test_the_deepseek_v3_shape_comes_from_its_one_home():
    dsv3 = load_bench("deepseek_v3_workload")
    spec = workloads.load_workloads()["dsv3_bal"].engine_spec()
    assert spec["model"] == dsv3.MODEL and spec["overrides"] == dsv3.OVERRIDES
    assert (spec["row_tokens"], spec["steps"], tuple(spec["window"])) == (dsv3.ROW_TOKENS, dsv3.STEPS, dsv3.WINDOW)
    # a workload's own row length overrides the shared one, and its peer is told it
    long_rows = workloads.load_workloads()["dsv3_8k_bal_c"]
    assert long_rows.engine_spec()["row_tokens"] == 8192 != dsv3.ROW_TOKENS
    assert long_rows.engine_spec()["overrides"] == dsv3.OVERRIDES
    command = load_bench("run").peer_command(long_rows, BENCH / "peer.json", None, tiny=False)
    assert command[command.index("--row-tokens") + 1] == "8192"


def test_peer_settings_follow_the_workload():
    declared = workloads.load_workloads()
    assert declared["single_bal_c_none"].peer_settings() == {
        "harness": "transformers_qwen3_moe", "script": "bench/hf_qwen3_moe.py", "experts": "grouped_mm",
        "recompute": False, "balanced": True}
    assert declared["dsv3_bal"].peer_settings()["recompute"] is True
    for settings in (w.peer_settings() for w in declared.values() if w.peer):
        assert (BENCH.parent / settings["script"]).is_file()


def test_the_lora_workloads_run_beside_peft_with_the_engine_adapters():
    declared = workloads.load_workloads()
    settings = declared["single_bal_c_lora"].peer_settings()
    assert settings["harness"] == "transformers_peft_qwen3_moe" and settings["lora"] == workloads.LORA
    assert declared["single_bal_c_none_lora"].peer_settings()["recompute"] is False
    command = load_bench("run").peer_command(declared["single_bal_c_lora"], BENCH / "x.json", None, tiny=True)
    assert "--lora" in command and "--balanced" in command and "--no-recompute" not in command


@pytest.mark.parametrize("entry", [
    {"peer": {"harness": "transformers_qwen3_moe"}, "packed": True},
    {"peer": {"harness": "transformers_qwen3_moe"}, "lora": True},
    {"peer": {"harness": "transformers_peft_qwen3_moe"}},  # peft's peer trains adapters: the workload must too
    {"peer": {"harness": "transformers_deepseek_v3"}},  # the default model is Qwen3
    {"recompte": "none"},  # a misspelt field
    {"fp8": ["everything"]},
], ids=["packed_peer", "lora_peer", "peft_peer_without_lora", "wrong_family", "misspelt", "fp8_target"])
def test_the_schema_refuses(entry):
    with pytest.raises(ValidationError):
        workloads.Workload.model_validate(entry)


def test_a_baseline_must_be_declared(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"workloads": {"a": {"baseline": "b"}}}))
    with pytest.raises(ValidationError, match="baseline"):
        workloads.read_workload_file(path)
