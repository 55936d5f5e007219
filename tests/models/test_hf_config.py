"""Every key of a Hugging Face config.json is honoured, known not to change the computation, or refused by name."""

import pytest
import torch

from openrecipes.models.common.activations import ACTIVATIONS, activation, check_activation
from openrecipes.models.common.hf_config import NO_COMPUTATION_KEYS
from openrecipes.models.muse_spark.config import MuseSparkConfig
from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig
from openrecipes.models.registry import get_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_activation_is_transformers_own(name):
    from transformers.activations import ACT2FN

    x = torch.linspace(-12, 12, 2001, dtype=torch.float64)
    expected = ACT2FN[name](x)
    got = activation(name)(x)
    assert torch.allclose(got, expected, rtol=1e-9, atol=1e-10), (name, (got - expected).abs().max())


def test_every_transformers_activation_is_implemented_or_refused():
    from transformers.activations import ACT2FN

    for name in ACT2FN:
        if name in ACTIVATIONS:
            continue
        with pytest.raises(ValueError, match=f"hidden_act='{name}'.*learned parameters"):
            check_activation(name)
    with pytest.raises(ValueError, match="hidden_act='gelu_tanh_plus'.*unknown"):
        check_activation("gelu_tanh_plus")


def test_default_transformers_config_imports_key_by_key(tmp_path):
    """Qwen3MoeConfig() as transformers writes it (to_dict and save_pretrained): every key is accounted for and the
    values are transformers' defaults, norm_topk_prob False among them."""
    reference = transformers.Qwen3MoeConfig()
    reference.save_pretrained(tmp_path)
    for raw in (reference.to_dict(), transformers.Qwen3MoeConfig.from_pretrained(tmp_path).to_dict()):
        config = Qwen3MoeConfig.from_hf_dict(raw)
        assert config.norm_topk_prob is False
        assert (config.hidden_act, config.num_experts, config.num_hidden_layers) == ("silu", 128, 24)
        assert (config.head_dim, config.rope_theta, config.pad_token_id) == (64, 10000.0, None)
        assert (config.output_router_logits, config.router_aux_loss_coef) == (False, 0.001)
    assert Qwen3MoeConfig.from_hf_json(tmp_path / "config.json") == Qwen3MoeConfig.from_hf_dict(reference.to_dict())


def test_every_computation_key_is_honoured(tmp_path):
    reference = transformers.Qwen3MoeConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-5, initializer_range=0.05,
        attention_bias=True, moe_intermediate_size=12, num_experts_per_tok=3, num_experts=6, norm_topk_prob=True,
        output_router_logits=True, router_aux_loss_coef=0.02, pad_token_id=3, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, max_position_embeddings=512)
    config = Qwen3MoeConfig.from_hf_dict(reference.to_dict())
    expected = dict(vocab_size=99, hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                    hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-5, initializer_range=0.05, attention_bias=True,
                    moe_intermediate_size=12, num_experts_per_tok=3, num_experts=6, norm_topk_prob=True,
                    output_router_logits=True, router_aux_loss_coef=0.02, pad_token_id=3, rope_theta=5000.0,
                    max_position_embeddings=512)
    assert {key: getattr(config, key) for key in expected} == expected


def test_transformers_4x_config_keys_are_accepted():
    """A 4.x config.json (Qwen3-30B-A3B's keys plus what 4.x's to_dict adds for every model)."""
    raw = get_config("qwen3-30b-a3b").to_hf_dict()
    raw.pop("rope_theta")
    raw.update(rope_theta=1e6, torch_dtype="bfloat16", transformers_version="4.51.0", max_window_layers=48,
               return_dict=True, output_hidden_states=False, torchscript=False, pruned_heads={},
               tie_encoder_decoder=False, is_decoder=False, add_cross_attention=False, chunk_size_feed_forward=0,
               max_length=20, min_length=0, do_sample=False, num_beams=1, temperature=1.0, top_k=50, top_p=1.0,
               id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, tokenizer_class=None, prefix=None,
               task_specific_params=None, problem_type=None, _name_or_path="", tf_legacy_loss=False,
               use_bfloat16=False, _attn_implementation_autoset=True, layer_types=["full_attention"] * 48)
    assert Qwen3MoeConfig.from_hf_dict(raw) == get_config("qwen3-30b-a3b")


@pytest.mark.parametrize("key, value, message", [
    ("hidden_act", "prelu", "hidden_act='prelu'"),
    ("hidden_act", "gelu_approx", "hidden_act='gelu_approx'"),
    ("attention_dropout", 0.1, "attention_dropout=0.1"),
    ("pruned_heads", {"0": [1]}, "pruned_heads"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("quantization_config", {"quant_method": "fp8"}, "'quantization_config'"),
    ("pad_token_id", 4096, "pad_token_id=4096"),
])
def test_computation_changing_keys_are_refused_by_name(key, value, message):
    raw = get_config("qwen3-moe-tiny").to_hf_dict()
    raw[key] = value
    with pytest.raises(ValueError, match=message):
        Qwen3MoeConfig.from_hf_dict(raw)


def test_missing_norm_topk_prob_means_transformers_default():
    raw = get_config("qwen3-moe-tiny").to_hf_dict()
    assert raw.pop("norm_topk_prob") is True
    assert Qwen3MoeConfig.from_hf_dict(raw).norm_topk_prob is False
    assert transformers.Qwen3MoeConfig().norm_topk_prob is False


def test_no_computation_keys_have_reasons():
    assert all(isinstance(why, str) and why for why in NO_COMPUTATION_KEYS.values())


def test_muse_spark_keys_follow_the_same_rule():
    config = get_config("muse-spark-tiny")
    raw = {**config.to_hf_dict(), "output_hidden_states": False, "torch_dtype": "bfloat16", "vision_config": {}}
    assert MuseSparkConfig.from_hf_dict(raw) == config
    assert MuseSparkConfig.from_hf_dict({**raw, "hidden_act": "gelu"}).hidden_act == "gelu"
    for key, value in (("attention_dropout", 0.1), ("hidden_act", "xielu"), ("rope_scaling", {"type": "yarn"})):
        with pytest.raises(ValueError, match=key):
            MuseSparkConfig.from_hf_dict({**raw, key: value})
