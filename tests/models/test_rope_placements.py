"""RoPE fields in every placement transformers reads (``rope_parameters``, ``rope_scaling``, top-level ``rope_theta``):
openrecipes computes what transformers computes from the same config.json, or refuses the field by name."""

import json

import pytest
import torch

import openrecipes
from tests.models.hf_reference import make_hf_model

pytest.importorskip("transformers")

DEFAULT = {"rope_type": "default"}
# placement name -> the RoPE keys written into config.json (every other RoPE key removed)
HONOURED = {
    "rope_parameters only": {"rope_parameters": {**DEFAULT, "rope_theta": 500.0}},
    "rope_scaling only (4.x)": {"rope_scaling": {"type": "default"}, "rope_theta": 700.0},
    "both agreeing": {"rope_parameters": {**DEFAULT, "rope_theta": 500.0},
                      "rope_scaling": {**DEFAULT, "rope_theta": 500.0}},
    # transformers reads rope_scaling first: its rope_theta wins
    "both disagreeing on rope_theta": {"rope_parameters": {**DEFAULT, "rope_theta": 1e6},
                                       "rope_scaling": {**DEFAULT, "rope_theta": 500.0}},
    # a rope_scaling without rope_theta replaces rope_parameters whole: the top-level rope_theta is used
    "rope_scaling without theta beside rope_parameters": {"rope_parameters": {**DEFAULT, "rope_theta": 1e6},
                                                          "rope_scaling": DEFAULT, "rope_theta": 300.0},
    "empty rope_scaling beside rope_parameters": {"rope_parameters": {**DEFAULT, "rope_theta": 500.0},
                                                  "rope_scaling": {}},
    "rope_parameters beside a top-level rope_theta": {"rope_parameters": {**DEFAULT, "rope_theta": 500.0},
                                                      "rope_theta": 9e5},
    "rope_parameters without theta": {"rope_parameters": DEFAULT, "rope_theta": 800.0},
}
# placement name -> (RoPE keys, the field and value the error must name)
REFUSED = {
    "linear x2 in rope_scaling beside plain rope_parameters": (
        {"rope_parameters": {**DEFAULT, "rope_theta": 500.0}, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        "rope_scaling.rope_type='linear'"),
    "yarn x4 in rope_scaling beside plain rope_parameters": (
        {"rope_parameters": {**DEFAULT, "rope_theta": 500.0},
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
        "rope_scaling.rope_type='yarn'"),
    "linear in rope_scaling only (4.x 'type')": (
        {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 500.0}, "rope_scaling.rope_type='linear'"),
    "yarn in rope_parameters": (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0}},
        "rope_parameters.rope_type='yarn'"),
    # transformers ignores a rope_parameters that rope_scaling replaces; a scaled one there is still refused
    "dynamic in rope_parameters under a plain rope_scaling": (
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}, "rope_scaling": {**DEFAULT, "rope_theta": 5.0}},
        "rope_parameters.rope_type='dynamic'"),
    "unknown rope_type": ({"rope_parameters": {"rope_type": "banana", "rope_theta": 500.0}},
                          "rope_parameters.rope_type='banana'"),
    "a factor beside a default rope_type": (
        {"rope_parameters": {**DEFAULT, "factor": 2.0, "rope_theta": 500.0}}, "rope_parameters.factor=2.0"),
    "type contradicting rope_type": (
        {"rope_scaling": {"type": "linear", "rope_type": "default"}}, "rope_scaling.type='linear'"),
    "partial_rotary_factor": ({"rope_parameters": {**DEFAULT, "partial_rotary_factor": 0.5}},
                              "rope_parameters.partial_rotary_factor=0.5"),
    "a string rope_theta": ({"rope_parameters": {**DEFAULT, "rope_theta": "500"}}, "rope_parameters.rope_theta"),
    "rope_scaling not an object": ({"rope_scaling": "linear"}, "rope_scaling"),
}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny transformers Qwen3-MoE saved once; each test rewrites only the RoPE keys of its config.json."""
    path = tmp_path_factory.mktemp("hf")
    make_hf_model("mha_bias_top1").save_pretrained(path)
    return path


def _with_rope_keys(saved_model, target, rope_keys):
    for item in saved_model.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    raw = json.loads((target / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        raw.pop(key, None)
    raw.update(json.loads(json.dumps(rope_keys)))
    (target / "config.json").write_text(json.dumps(raw))
    return target


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("placement", list(HONOURED))
def test_honoured_placements_compute_as_transformers(saved_model, tmp_path, placement):
    from transformers import Qwen3MoeForCausalLM

    path = _with_rope_keys(saved_model, tmp_path, HONOURED[placement])
    hf_model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    native = openrecipes.from_hf(path, dtype=torch.float32)
    assert native.config.rope_theta == hf_model.config.rope_parameters["rope_theta"]
    input_ids = torch.randint(0, hf_model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert _rel_err(native(input_ids), hf_model(input_ids).logits) <= 1e-5


@pytest.mark.parametrize("placement", list(REFUSED))
def test_unimplemented_rope_is_refused_by_name(saved_model, tmp_path, placement):
    rope_keys, named = REFUSED[placement]
    path = _with_rope_keys(saved_model, tmp_path, rope_keys)
    with pytest.raises(ValueError) as refused:
        openrecipes.from_hf(path, dtype=torch.float32)
    message = str(refused.value)
    assert named in message and "config.json" in message and "\n" not in message


def test_mrope_sections_come_from_the_placement_transformers_reads():
    from transformers import Qwen3VLMoeConfig as HFConfig

    from openrecipes.models.qwen3_vl_moe.config import Qwen3VLMoeConfig
    from tests.models.test_qwen3_vl_moe_parity import TINY

    raw = HFConfig(**TINY).to_dict()
    text = raw["text_config"]
    text.pop("rope_theta", None)
    text["rope_parameters"] = {**DEFAULT, "rope_theta": 1e6, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    text["rope_scaling"] = {**DEFAULT, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    expected = HFConfig.from_dict(json.loads(json.dumps(raw))).text_config.rope_parameters
    native = Qwen3VLMoeConfig.from_hf_dict(raw)
    assert list(native.mrope_section) == expected["mrope_section"] == [4, 2, 2]
    assert native.text.rope_theta == expected["rope_theta"]  # the text config's own default: no theta beside
