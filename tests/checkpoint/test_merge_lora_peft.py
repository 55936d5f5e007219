"""merge-lora equals PEFT's own merge (`PeftModel.merge_and_unload`) or refuses the adapter by name.

Adapters are made by peft itself on transformers' Qwen3MoeForCausalLM (attention through target_modules, the fused
experts through target_parameters), every factor randomised, then merged both ways and compared tensor by tensor.
Hostile adapters (configs, keys, tensors, safetensors headers) each get a one-line error naming what is wrong."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch

from openrecipes.cli import main
from tests.checkpoint.lora_helpers import randomize
from tests.models.hf_reference import make_hf_model

peft = pytest.importorskip("peft")

CONFIG = "pad_token"  # hidden 32, 2F = 24, F = 12, 4 experts, 2 layers
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("merge") / "base"
    make_hf_model(CONFIG).save_pretrained(path)
    return path


def _peft_adapter(out: Path, order: list[str], **config) -> Path:
    """A peft-made adapter (every A and B random) with ``target_parameters`` written in ``order``."""
    config = {"target_modules": ["q_proj", "v_proj"], **config}
    lora = peft.LoraConfig(target_parameters=order, **config)
    model = peft.get_peft_model(make_hf_model(CONFIG), lora)
    randomize(model, "lora_", seed=3)
    model.save_pretrained(out)
    config_path = out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    # peft writes them in set order, which varies with PYTHONHASHSEED (and may add some: all-linear adds the router)
    saved["target_parameters"] = order + sorted(set(saved["target_parameters"]) - set(order))
    config_path.write_text(json.dumps(saved))
    return out


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(path, torch_dtype=torch.float32).state_dict()


@pytest.mark.parametrize("order, config", [
    ([GATE_UP, DOWN], dict(r=3, lora_alpha=6, rank_pattern={"layers.1.self_attn.q_proj": 5, "down_proj": 2})),
    ([DOWN, GATE_UP], dict(r=3, lora_alpha=6)),
    ([DOWN, GATE_UP], dict(r=4, lora_alpha=3, use_rslora=True, alpha_pattern={"v_proj": 9, "gate_up_proj": 1.5})),
    ([DOWN, GATE_UP], dict(r=2, lora_alpha=5, target_modules="all-linear", exclude_modules=["k_proj"])),
    ([DOWN, GATE_UP], dict(r=2, lora_alpha=5, target_modules=r".*\.layers\.1\..*(q|v)_proj")),
], ids=["gate_up-first-rank-pattern", "down-first", "down-first-rslora-alpha-pattern", "all-linear-exclude",
        "regex-targets-layer-1"])
def test_merge_lora_equals_peft_merge_and_unload(base_dir: Path, tmp_path: Path, order, config) -> None:
    from transformers import Qwen3MoeForCausalLM

    adapter = _peft_adapter(tmp_path / "adapter", order, **config)
    assert main(["convert", "merge-lora", str(base_dir), str(adapter), "--out", str(tmp_path / "merged")]) == 0
    hf = Qwen3MoeForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    expected = peft.PeftModel.from_pretrained(hf, adapter).merge_and_unload().state_dict()
    got = _hf_state(tmp_path / "merged")
    base = _hf_state(base_dir)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=2e-6, msg=name)
    changed = {name for name in base if not torch.equal(base[name], expected[name])}
    assert {name.rsplit(".", 2)[-2] for name in changed} >= {"q_proj", "v_proj", "experts"}  # every kind merged
    assert any(name.endswith("experts.down_proj") for name in changed)
    assert any(name.endswith("experts.gate_up_proj") for name in changed)
    assert any(name.endswith("mlp.gate.weight") for name in changed) == (config.get("target_modules") == "all-linear")


@pytest.mark.parametrize("init", ["orthogonal", "mica", "gaussian"])
def test_an_initialisation_that_leaves_the_base_alone_merges_as_peft_loads_it(base_dir: Path, tmp_path: Path,
                                                                             init: str) -> None:
    """A saved adapter's factors replace whatever the initialisation drew: merge-lora merges it as peft does."""
    from transformers import Qwen3MoeForCausalLM

    # attention only, at an even rank: peft's orthogonal initialisation needs one, its MiCA takes no expert parameters
    adapter = _peft_adapter(tmp_path / "adapter", [], r=4, lora_alpha=6)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": init}))
    assert main(["convert", "merge-lora", str(base_dir), str(adapter), "--out", str(tmp_path / "merged")]) == 0
    hf = Qwen3MoeForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    expected = peft.PeftModel.from_pretrained(hf, adapter).merge_and_unload().state_dict()
    got = _hf_state(tmp_path / "merged")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=2e-6, msg=name)


# ---- hostile adapters: each refused with one line naming the problem ----------------------------------------------

@pytest.fixture(scope="module")
def template(base_dir: Path, tmp_path_factory) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    adapter = _peft_adapter(tmp_path_factory.mktemp("template") / "adapter", [GATE_UP, DOWN], r=3, lora_alpha=6)
    return json.loads((adapter / "adapter_config.json").read_text()), load_file(adapter / "adapter_model.safetensors")


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = Q_A.replace("lora_A", "lora_B")


def _raw_safetensors(header: dict | list | str, data: bytes, length: int | None = None) -> bytes:
    """A safetensors file from its parts, ``header`` as given (JSON text or a value to encode), ``length`` as told."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _with(config_changes: dict | None = None, *, drop=(), add: dict | None = None):
    def mutate(config: dict, tensors: dict) -> tuple[dict | str, dict | bytes]:
        config = {**config, **(config_changes or {})}
        tensors = {k: v for k, v in tensors.items() if k not in drop}
        tensors.update(add or {})
        return config, tensors
    return mutate


def _without(field: str):
    def mutate(config: dict, tensors: dict):
        return {k: v for k, v in config.items() if k != field}, tensors
    return mutate


def _config_text(text: str):
    return lambda config, tensors: (text, tensors)


def _weights_bytes(data: bytes):
    return lambda config, tensors: (config, data)


F32_16 = bytes(16)  # four float32 zeros
F32_4 = json.dumps(_entry("F32", [4], 0, 16))
HOSTILE = {
    # configs
    "config-list": (_config_text("[1, 2]"), "adapter_config.json: an adapter config is a JSON object, not a list"),
    "config-string": (_config_text('"LORA"'), "not a str"),
    "config-not-json": (_config_text("{r: 3"), "adapter_config.json: not valid JSON"),
    "config-deep-nesting": (_config_text('{"r": ' + "[" * 100000 + "]" * 100000 + "}"), "not valid JSON"),
    "missing-r": (_without("r"), "r is missing"),
    "missing-alpha": (_without("lora_alpha"), "lora_alpha is missing"),
    "r-zero": (_with({"r": 0}), "r is 0, not a positive integer"),
    "r-negative": (_with({"r": -3}), "r is -3, not a positive integer"),
    "r-float": (_with({"r": 3.0}), "r is 3.0, not a positive integer"),
    "r-huge": (_with({"r": 10**400, "use_rslora": True}), "not a positive integer"),
    "alpha-huge-int": (_with({"lora_alpha": 10**400}), "not a finite number"),
    "r-disagrees": (_with({"r": 4}), "are not rank 4"),
    "rank-pattern-disagrees": (_with({"rank_pattern": {"v_proj": 2}}), "v_proj.lora_A.weight: .* not rank 2"),
    "rank-pattern-zero": (_with({"rank_pattern": {"q_proj": 0}}), r"rank_pattern\['q_proj'\] is 0"),
    "rank-pattern-bad-regex": (_with({"rank_pattern": {"(": 2}}), "is not a regular expression"),
    "alpha-nan": (_config_text('{"peft_type": "LORA", "r": 3, "lora_alpha": NaN}'), "lora_alpha is NaN"),
    "alpha-inf": (_config_text('{"peft_type": "LORA", "r": 3, "lora_alpha": Infinity}'), "lora_alpha is Infinity"),
    "alpha-pattern-nan": (_with({"alpha_pattern": {"q_proj": math.nan}}), r"alpha_pattern\['q_proj'\] is NaN"),
    "target-parameters-int": (_with({"target_parameters": 5}), "target_parameters must be a list of strings"),
    "target-parameters-other": (_with({"target_parameters": ["self_attn.q_proj.bias"]}),
                                "names 'self_attn.q_proj.bias'"),
    "targeted-twice": (_with({"target_parameters": [GATE_UP, DOWN, "self_attn.q_proj.weight"]}),
                       "self_attn.q_proj is targeted by both target_modules and target_parameters"),
    "peft-type": (_with({"peft_type": "LOHA"}), "peft_type 'LOHA'"),
    "dora": (_with({"use_dora": True}), "use_dora is set"),
    "modules-to-save": (_with({"modules_to_save": ["lm_head"]}), "modules_to_save is set"),
    "bias": (_with({"bias": "all"}), "bias is 'all'"),
    "layers-to-transform": (_with({"layers_to_transform": [0]}), "layers_to_transform is set"),
    "layer-replication": (_with({"layer_replication": [[0, 2]]}), "layer_replication is set"),
    "fan-in-fan-out": (_with({"fan_in_fan_out": True}), "fan_in_fan_out is set"),
    "pissa-init": (_with({"init_lora_weights": "pissa"}), "init_lora_weights \"pissa\": PEFT would rewrite"),
    "olora-init": (_with({"init_lora_weights": "olora"}), "init_lora_weights \"olora\": PEFT would rewrite"),
    "init-unknown": (_with({"init_lora_weights": "True"}), "init_lora_weights \"True\" is not a value PEFT knows"),
    "init-number": (_with({"init_lora_weights": 1}), "init_lora_weights 1 is not a value PEFT knows"),
    "dropout-string": (_with({"lora_dropout": "x"}), "lora_dropout is \"x\", not a probability"),
    "task-type-unknown": (_with({"task_type": "NOT_A_TASK"}), "task_type \"NOT_A_TASK\" is not one of PEFT's"),
    "untargeted-module": (_with({"target_modules": ["v_proj"]}), "does not target model.layers.0.self_attn.q_proj"),
    "untargeted-by-regex": (_with({"target_modules": r".*\.v_proj"}),
                            "does not target model.layers.0.self_attn.q_proj"),
    "excluded-module": (_with({"exclude_modules": ["layers.1.self_attn.q_proj"]}),
                        "does not target model.layers.1.self_attn.q_proj"),
    "target-modules-bad-regex": (_with({"target_modules": "a)(b"}), "target_modules 'a\\)\\(b' is not a regular"),
    "all-linear-unresolved": (_with({"target_modules": "all-linear"}), "target_modules is 'all-linear'"),
    "router-untargeted": (_with(add={"base_model.model.model.layers.0.mlp.gate.lora_A.weight": torch.zeros(3, 32),
                                     "base_model.model.model.layers.0.mlp.gate.lora_B.weight": torch.zeros(4, 3)}),
                          "does not target model.layers.0.mlp.gate"),
    "dropout-with-parameters": (_with({"lora_dropout": 0.1}), "lora_dropout must be 0 with target_parameters"),
    # keys
    "only-a": (_with(drop=[Q_B]), "q_proj.lora_A.weight' has no lora_B partner"),
    "only-b": (_with(drop=[Q_A]), "q_proj.lora_B.weight' has no lora_A partner"),
    "embedding": (_with(add={"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(3, 64)}),
                  "embedding adapters"),
    "modules-to-save-key": (_with(add={"base_model.model.lm_head.modules_to_save.default.weight": torch.zeros(64, 32)}),
                            "modules_to_save copies"),
    "bias-key": (_with(add={Q_B.replace(".weight", ".bias"): torch.zeros(32)}), "lora_B.bias': a bias"),
    "inner-wrapper-without-target": (
        _with(add={Q_A.replace("q_proj.", "q_proj.base_layer."): torch.zeros(3, 32),
                   Q_B.replace("q_proj.", "q_proj.base_layer."): torch.zeros(32, 3)}),
        "target_parameters does not target model.layers.0.self_attn.q_proj"),
    # tensors
    "int-tensor": (_with(add={Q_A: torch.zeros(3, 32, dtype=torch.int32)}), "is I32; LoRA factors must be"),
    "bool-tensor": (_with(add={Q_A: torch.zeros(3, 32, dtype=torch.bool)}), "is BOOL"),
    "fp8-tensor": (_with(add={Q_A: torch.zeros(3, 32).to(torch.float8_e4m3fn)}), "is F8_E4M3"),
    "nan-tensor": (_with(add={Q_A: torch.full((3, 32), math.nan)}), "q_proj.lora_A.weight' holds NaN or inf"),
    "inf-tensor": (_with(add={Q_B: torch.full((32, 3), math.inf)}), "holds NaN or inf"),
    # safetensors headers
    "header-short-file": (_weights_bytes(b"\x01\x02"), "shorter than the 8-byte header length"),
    "header-length-past-end": (_weights_bytes(_raw_safetensors({}, b"", length=10**6)), "runs past the end"),
    "header-not-json": (_weights_bytes(struct.pack("<Q", 4) + b"\xff{{{"), "header is not valid JSON"),
    "header-list": (_weights_bytes(_raw_safetensors([1], b"")), "header is a JSON list"),
    "header-huge-shape": (_weights_bytes(_raw_safetensors({Q_A: _entry("F32", [2**40, 2**40], 0, 16)}, F32_16)),
                          r"shape \[1099511627776, 1099511627776\] of F32 needs"),
    "header-offsets-outside": (_weights_bytes(_raw_safetensors({Q_A: _entry("F32", [4], 8, 24)}, F32_16)),
                               "lie outside the data region"),
    "header-overlap": (_weights_bytes(_raw_safetensors({Q_A: _entry("F32", [2, 2], 0, 16),
                                                        Q_B: _entry("F32", [2, 1], 8, 16)}, F32_16)), "overlap"),
    "header-unknown-dtype": (_weights_bytes(_raw_safetensors({Q_A: _entry("Q7", [4], 0, 16)}, F32_16)),
                             "unknown dtype 'Q7'"),
    "header-negative-shape": (_weights_bytes(_raw_safetensors({Q_A: _entry("F32", [-4], 0, 16)}, F32_16)),
                              "not a list of non-negative integers"),
    "header-duplicate-name": (_weights_bytes(_raw_safetensors(f'{{"{Q_A}": {F32_4}, "{Q_A}": {F32_4}}}', F32_16)),
                              "more than once"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_adapter_is_refused_by_name(base_dir: Path, template, tmp_path: Path, capsys, case: str) -> None:
    from safetensors.torch import save_file

    mutate, message = HOSTILE[case]
    config, tensors = mutate(*template)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    weights = adapter / "adapter_model.safetensors"
    if isinstance(tensors, bytes):
        weights.write_bytes(tensors)
    else:
        save_file(tensors, str(weights))
    out = tmp_path / "merged"
    assert main(["convert", "merge-lora", str(base_dir), str(adapter), "--out", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and str(adapter) in error, error
    assert re.search(message, error), error
    assert not out.exists()
