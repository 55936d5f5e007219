"""Native GLM-4.5-MoE against transformers' Glm4MoeForCausalLM: same weights, fp32, CPU; HF weight round trip; the
MTP layers a checkpoint declares skipped on import."""

import json

import pytest
import torch
import torch.nn.functional as F

import openrecipes
from openrecipes.checkpoint.hf import save_hf

transformers = pytest.importorskip("transformers")

# 3 layers (the first dense), 8 routed experts in 2 groups (1 kept), 1 shared expert, GQA 4/2 heads of 16 (heads *
# head_dim != hidden), half of each head rotated, biases, qk-norm
TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-5,
            num_nextn_predict_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                         "partial_rotary_factor": 0.5})
VARIANTS = {
    "tiny": {},
    # transformers' own tester (tests/models/glm4_moe: CausalLMModelTester's sizes, 8 experts, all 8 per token, one
    # group, the config class's defaults otherwise: no head_dim key, no biases, no qk-norm, half of each head rotated)
    "hf_tester": dict(vocab_size=99, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=None,
                      n_routed_experts=8, num_experts_per_tok=8, n_group=1, topk_group=1, use_qk_norm=False,
                      attention_bias=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "full_rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}),
    "quarter_rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.25}),
    "no_qk_norm_no_bias": dict(use_qk_norm=False, attention_bias=False),
    "two_dense": dict(first_k_dense_replace=2),
    "all_moe": dict(first_k_dense_replace=0),
    "groups": dict(n_group=4, topk_group=2, num_experts_per_tok=3),
    "no_renorm": dict(norm_topk_prob=False, routed_scaling_factor=1.0),
    "shared_2": dict(n_shared_experts=2),
    "gelu": dict(hidden_act="gelu"),
    "norm_eps": dict(rms_norm_eps=1e-2),
    # the published configs' spelling: partial_rotary_factor and rope_theta at the top level, rope_scaling null
    # (the saved config.json is rewritten so; _published_spelling)
    "top_level_rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 2000.0,
                                            "partial_rotary_factor": 0.25}),
}


def _published_spelling(path) -> None:
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw.update(rope_scaling=None, rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"])
    (path / "config.json").write_text(json.dumps(raw))


def _hf_config(variant: str):
    kwargs = {**TINY, **VARIANTS[variant]}
    if kwargs.get("head_dim") is None:
        kwargs.pop("head_dim", None)
    return transformers.Glm4MoeConfig(**kwargs)


def make_hf_model(variant: str, seed: int = 0, std: float = 0.08):
    config = _hf_config(variant)
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(config).float().eval()
    with torch.no_grad():  # far from uniform routing and attention; a correction bias that changes the choice
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else std * torch.randn_like(param))
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(config.n_routed_experts))
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
    if variant == "top_level_rope":
        _published_spelling(tmp_path)
    native = openrecipes.from_hf(tmp_path, dtype=torch.float32)
    assert native.config.rotary_dim == int(native.config.head_dim * hf_model.config.rope_parameters.get(
        "partial_rotary_factor", 1.0))
    assert type(native).__name__ == "Glm4MoeForCausalLM"
    config = hf_model.config
    assert [layer.dense for layer in native.model.layers.values()] == [
        i < config.first_k_dense_replace for i in range(config.num_hidden_layers)]

    input_ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
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
        expected = hf_grad(hf_model, name, config.moe_intermediate_size)
        if expected.abs().max() == 0:  # an expert no token chose
            assert param.grad is None or param.grad.abs().max() == 0, name
            continue
        assert rel_err(param.grad, expected) <= 1e-5, name
        checked += 1
    assert checked >= len([p for p in native.parameters() if p.requires_grad]) - 3


@pytest.mark.parametrize("change", ["rotary", "group_limit", "qk_norm"])
def test_the_parity_can_fail(change, tmp_path):
    """A native model that rotates the whole head, ignores the group limit or skips the qk-norm computes other
    logits: the parity above sees each of these fields."""
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    assert rel_err(native(input_ids), hf_model(input_ids).logits) <= 1e-5
    for layer in native.model.layers.values():
        if change == "rotary":
            layer.self_attn.rotary_dim = layer.self_attn.head_dim
        elif change == "qk_norm":
            layer.self_attn.q_norm = layer.self_attn.k_norm = None
        elif not layer.dense:
            layer.mlp.gate.top_groups = TINY["n_group"]
    if change == "rotary":  # the angles must then cover the whole head as well
        import dataclasses
        native.config = dataclasses.replace(native.config, partial_rotary_factor=1.0)
    assert rel_err(native(input_ids), hf_model(input_ids).logits) > 1e-3


def test_hf_weights_round_trip(tmp_path):
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path / "hf")
    native = openrecipes.from_hf(tmp_path / "hf")
    save_hf(native, tmp_path / "out")
    back = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    expected, got = hf_model.state_dict(), back.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    reread = openrecipes.from_hf(tmp_path / "out")
    for (name, a), (_, b) in zip(native.state_dict().items(), reread.state_dict().items()):
        assert torch.equal(a, b), name


def _with_extra_layer(path, *, declared: int) -> None:
    """The saved tiny checkpoint plus one more layer's tensor (a multi-token-prediction layer, were it declared)."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = declared
    (path / "config.json").write_text(json.dumps(raw))
    weights = next(path.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors[f"model.layers.{TINY['num_hidden_layers']}.eh_proj.weight"] = torch.ones(4, 4)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_a_declared_mtp_layer_is_skipped_with_a_note_and_an_undeclared_layer_refused(tmp_path):
    make_hf_model("tiny").save_pretrained(tmp_path / "mtp")
    _with_extra_layer(tmp_path / "mtp", declared=1)
    with pytest.warns(UserWarning, match=r"skipped 1 tensor\(s\) of the multi-token-prediction layer model\.layers\.3"):
        openrecipes.from_hf(tmp_path / "mtp")
    make_hf_model("tiny").save_pretrained(tmp_path / "extra")
    _with_extra_layer(tmp_path / "extra", declared=0)
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.3\.eh_proj\.weight'"):
        openrecipes.from_hf(tmp_path / "extra")
