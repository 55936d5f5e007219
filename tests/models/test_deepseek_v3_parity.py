"""Native DeepSeek-V3 against transformers' DeepseekV3ForCausalLM: same weights, fp32, CPU; HF weight round trip."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import openrecipes
from openrecipes.models.common.rope_scaling import RopeScaling
from openrecipes.checkpoint.hf import save_hf

transformers = pytest.importorskip("transformers")

# 3 layers (the first dense), 8 routed experts in 2 groups (1 kept), 1 shared expert, hidden 64; value heads
# narrower than query/key heads
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
            q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
            norm_topk_prob=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
VARIANTS = {
    "tiny": {},
    # one query projection, rotate-half RoPE, no renormalisation, two shared experts, biases
    "plain_query": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, n_shared_experts=2,
                        attention_bias=True, topk_group=2, num_experts_per_tok=3),
    # transformers' latent norms keep their default epsilon (1e-6) whatever rms_norm_eps says; the others take it
    "norm_eps": dict(rms_norm_eps=1e-2),
    # scaled RoPE past the trained length (8 positions here, 20 in the input): YaRN as DeepSeek-V3 publishes it
    # (mscale and mscale_all_dim: cos/sin and the softmax corrected), YaRN without them, linear
    "yarn": dict(max_position_embeddings=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "yarn_plain": dict(max_position_embeddings=32, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 3.0, "original_max_position_embeddings": 8,
        "beta_fast": 4, "beta_slow": 2, "truncate": False}),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.5}),
    # NTK-aware dynamic scaling: 8 trained positions, 20 in the input, so the base grows with the batch's length
    "dynamic": dict(max_position_embeddings=8, rope_parameters={"rope_type": "dynamic", "rope_theta": 500.0,
                                                                 "factor": 3.0}),
}


def make_hf_model(variant: str, seed: int = 0, std: float = 0.08):
    config = transformers.DeepseekV3Config(**{**TINY, **VARIANTS[variant]})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():  # far from uniform routing and attention; a correction bias that changes the choice
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else std * torch.randn_like(param))
        for layer in model.model.layers[TINY["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(TINY["n_routed_experts"]))
    return model


def lm_loss(logits, input_ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_grad(hf_model, native_name: str, ffn: int):
    params = dict(hf_model.named_parameters())
    if native_name.endswith(("experts.gate_proj", "experts.up_proj")):
        fused = params[native_name.rsplit(".", 1)[0] + ".gate_up_proj"].grad
        return fused[:, :ffn] if native_name.endswith("gate_proj") else fused[:, ffn:]
    return params[native_name].grad


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_loss_and_grads_match_transformers(variant, tmp_path):
    hf_model = make_hf_model(variant)
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path, dtype=torch.float32)
    assert type(native).__name__ == "DeepseekV3ForCausalLM"
    assert [layer.dense for layer in native.model.layers.values()] == [True, False, False]

    input_ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    hf_logits = hf_model(input_ids).logits
    native_logits = native(input_ids)
    assert rel_err(native_logits, hf_logits) <= 1e-5
    hf_loss, native_loss = lm_loss(hf_logits, input_ids), lm_loss(native_logits, input_ids)
    assert abs(native_loss.item() - hf_loss.item()) / abs(hf_loss.item()) <= 1e-5
    hf_loss.backward()
    native_loss.backward()

    checked = 0
    for name, param in native.named_parameters():
        if not param.requires_grad:  # the correction bias steers the choice only
            assert name.endswith("e_score_correction_bias") and param.grad is None
            continue
        expected = hf_grad(hf_model, name, TINY["moe_intermediate_size"])
        if expected.abs().max() == 0:
            assert param.grad is None or param.grad.abs().max() == 0, name
            continue
        assert rel_err(param.grad, expected) <= 1e-5, name
        checked += 1
    assert checked >= len([p for p in native.parameters() if p.requires_grad]) - 3


def test_routing_differs_without_the_group_limit(tmp_path):
    """The parity above must be able to fail: a native model that ignores the group limit computes other logits."""
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    for layer in list(native.model.layers.values())[1:]:
        layer.mlp.gate.top_groups = TINY["n_group"]
    assert rel_err(native(input_ids), hf_model(input_ids).logits) > 1e-3


def test_hf_weights_round_trip(tmp_path):
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path / "hf")
    native = openrecipes.from_hf(tmp_path / "hf")
    save_hf(native, tmp_path / "out")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    expected, got = hf_model.state_dict(), back.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    reread = openrecipes.from_hf(tmp_path / "out")
    for (name, a), (_, b) in zip(native.state_dict().items(), reread.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_rope_scaling_not_computed_here_is_refused_naming_the_field(tmp_path):
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}  # two frequency sets: not computed here
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='longrope' is not supported"):
        openrecipes.from_hf(tmp_path)


@pytest.mark.parametrize("variant", ["yarn", "dynamic"])
def test_scaling_matters_past_the_trained_length(tmp_path, variant):
    """The scaled-RoPE parity above must be able to fail: plain RoPE on the checkpoint gives other logits."""
    from openrecipes.models.common.rope_scaling import RopeScaling

    hf_model = make_hf_model(variant)
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    assert rel_err(native(input_ids), hf_model(input_ids).logits) <= 1e-5
    native.config = dataclasses.replace(native.config, rope_scaling=RopeScaling())
    assert rel_err(native(input_ids), hf_model(input_ids).logits) > 1e-3


def test_dynamic_scaling_is_plain_rope_within_the_trained_length(tmp_path):
    hf_model = make_hf_model("dynamic")
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    plain = dataclasses.replace(native.config, rope_scaling=RopeScaling())
    scaled = native(input_ids)
    native.config = plain
    assert torch.equal(native(input_ids), scaled)
    assert rel_err(scaled, hf_model(input_ids).logits) <= 1e-5


def test_the_published_config_loads_with_its_yarn(tmp_path):
    """deepseek-ai/DeepSeek-V3's config.json (its rope_scaling and MTP count as published) is the registered size."""
    from openrecipes.models.deepseek_v3 import DeepseekV3Config
    from openrecipes.models.registry import get_config

    published = {**get_config("deepseek-v3-671b").to_hf_dict(), "num_nextn_predict_layers": 1, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"}}
    config = DeepseekV3Config.from_hf_dict(published)
    assert config.keep_mtp  # read from a config.json, the model holds the MTP layer it declares; the registry's not
    assert dataclasses.replace(config, keep_mtp=False) == get_config("deepseek-v3-671b")
    assert config.rope_scaling.cos_sin_factor == 1.0  # mscale and mscale_all_dim alike: the factors cancel
    assert config.softmax_scale == pytest.approx((1 + 0.1 * math.log(40)) ** 2 / math.sqrt(192))


def _with_extra_layer(path, *, declared: int) -> None:
    """The saved tiny checkpoint plus one more layer's tensor (a multi-token-prediction layer, were it declared)."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = declared
    (path / "config.json").write_text(json.dumps(raw))
    weights = next(path.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors[f"model.layers.{TINY['num_hidden_layers']}.input_layernorm.weight"] = torch.ones(TINY["hidden_size"])
    save_file(tensors, weights, metadata={"format": "pt"})


def test_a_layer_past_the_declared_ones_is_refused_and_an_mtp_layer_skipped(tmp_path):
    from openrecipes.checkpoint.hf import from_hf

    make_hf_model("tiny").save_pretrained(tmp_path / "mtp")
    _with_extra_layer(tmp_path / "mtp", declared=1)
    with pytest.warns(UserWarning, match=r"skipped 1 tensor\(s\) of the multi-token-prediction layer model\.layers\.3"):
        from_hf(tmp_path / "mtp", keep_mtp=False)  # a run that does not train it
    with pytest.raises(ValueError, match="missing tensor"):  # a model that keeps it needs all of it
        openrecipes.from_hf(tmp_path / "mtp")
    make_hf_model("tiny").save_pretrained(tmp_path / "extra")
    _with_extra_layer(tmp_path / "extra", declared=0)  # nothing declares it: never dropped without a word
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.3\.input_layernorm\.weight'"):
        openrecipes.from_hf(tmp_path / "extra")


def test_a_layer_count_the_tensors_do_not_hold_is_refused_before_building(tmp_path):
    import time

    make_hf_model("tiny").save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 10_000_000}))
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"num_hidden_layers=10000000, but the checkpoint's tensors hold layers 0 to 2"):
        openrecipes.from_hf(tmp_path)
    assert time.monotonic() - started < 30
