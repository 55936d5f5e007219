"""Native Qwen3.5-MoE against transformers' Qwen3_5MoeForCausalLM (its pure-torch delta rule and convolution, no
fla/causal-conv1d kernels): same weights, fp32, CPU; the HF weight round trip; packed documents as if alone."""

import pytest
import torch
import torch.nn.functional as F

import openrecipes
from openrecipes.checkpoint.hf import save_hf
from openrecipes.models.common.attention import Documents

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

# 4 layers (3 linear-attention, then full attention), 8 experts top-2 plus a shared expert, linear attention with
# 2 query/key heads for 4 value heads, GQA 4/2 heads of 16 (heads * head_dim != hidden), a quarter rotated
TINY = dict(vocab_size=96, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25})
VARIANTS = {
    "tiny": {},
    # transformers' own tester sizes (tests/models/qwen3_5_moe: CausalLMModelTester's, the config's defaults else)
    "hf_tester": dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=12,
                      shared_expert_intermediate_size=12, num_experts=8, num_experts_per_tok=2,
                      layer_types=["linear_attention", "full_attention"],
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "half_rotary_bias": dict(attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 5e4,
                                                                   "partial_rotary_factor": 0.5}),
    "full_first": dict(layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"]),
    "conv_2_equal_heads": dict(linear_conv_kernel_dim=2, linear_num_value_heads=2, linear_value_head_dim=8),
    "top1_gelu": dict(num_experts_per_tok=1, hidden_act="gelu", num_experts=5),
    "norm_eps": dict(rms_norm_eps=1e-2),
}
TOKENS = 70  # past one 64-token chunk of the delta rule, not a multiple of it


def make_hf_model(variant: str, seed: int = 0, std: float = 0.08):
    kwargs = {**TINY, **VARIANTS[variant]}
    config = transformers.Qwen3_5MoeTextConfig(**kwargs)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(config).float().eval()
    with torch.no_grad():  # far from uniform routing and attention; norms (zero-centred or not) perturbed
        for name, param in model.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif "norm" in name:
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(std * torch.randn_like(param))
    return model


def test_transformers_runs_its_torch_fallback():
    """No fla or causal-conv1d kernel here: transformers' side is its own pure-torch delta rule and convolution."""
    assert modeling.torch_chunk_gated_delta_rule.__module__ == modeling.__name__
    import importlib.util
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None


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


def _bound(native32, native64) -> float:
    """1e-5, or eight times how far this model's own fp32 result is from its fp64 one where that is more: the delta
    rule's fp32 rounding (transformers computes it in fp32 whatever the dtype) reaches ~1e-4 relative in gradients
    that sum a cancelling term over every token (A_log, dt_bias, the convolution), on both sides alike."""
    return max(1e-5, 8 * rel_err(native32, native64))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_loss_and_grads_match_transformers(variant, tmp_path):
    hf_model = make_hf_model(variant)
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path, dtype=torch.float32)
    exact = openrecipes.from_hf(tmp_path, dtype=torch.float64)
    assert type(native).__name__ == "Qwen35MoeForCausalLM"
    config = hf_model.config
    assert [layer.full_attention for layer in native.model.layers.values()] == [
        t == "full_attention" for t in config.layer_types]
    input_ids = torch.randint(0, config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    hf_logits, native_logits, exact_logits = hf_model(input_ids).logits, native(input_ids), exact(input_ids)
    assert rel_err(native_logits, hf_logits) <= _bound(native_logits, exact_logits)
    losses = [lm_loss(logits, input_ids) for logits in (hf_logits, native_logits, exact_logits)]
    assert abs(losses[1].item() - losses[0].item()) / abs(losses[0].item()) <= 1e-5
    for loss in losses:
        loss.backward()
    checked = 0
    exact_params = dict(exact.named_parameters())
    for name, param in native.named_parameters():
        expected = hf_grad(hf_model, name, config.moe_intermediate_size)
        if expected.abs().max() == 0:  # an expert no token chose
            assert param.grad is None or param.grad.abs().max() == 0, name
            continue
        bound = _bound(param.grad.double(), exact_params[name].grad)
        assert rel_err(param.grad, expected) <= bound, (name, bound)
        checked += 1
    assert checked >= len(list(native.parameters())) - 3


@pytest.mark.parametrize("change", ["zero_centred_norm", "rotary", "shared_gate", "conv_history"])
def test_the_parity_can_fail(change, tmp_path):
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    assert rel_err(native(input_ids), hf_model(input_ids).logits) <= 1e-5
    for layer in native.model.layers.values():
        if change == "zero_centred_norm":
            layer.input_layernorm.zero_centered = False
            layer.input_layernorm.weight.data.add_(1.0)  # (1 + w) x / rms read as w x / rms: the same unless ...
            layer.input_layernorm.weight.data.mul_(1.1)  # ... the weight is read as another one
        elif change == "rotary" and layer.full_attention:
            layer.self_attn.rotary_dim = layer.self_attn.head_dim
        elif change == "shared_gate":
            layer.mlp.shared_expert_gate.weight.data.zero_()  # sigmoid(0) = 1/2, not the learned gate
        elif change == "conv_history" and not layer.full_attention:
            layer.linear_attn.conv1d.weight.data[..., :-1] = 0.0  # only the current token
    if change == "rotary":
        import dataclasses
        native.config = dataclasses.replace(native.config, partial_rotary_factor=1.0)
    assert rel_err(native(input_ids), hf_model(input_ids).logits) > 1e-3


def test_packed_documents_match_each_document_alone(tmp_path):
    """Packed rows: each document's logits equal its own forward (linear attention restarts from a zero state and
    convolution history at each document; full attention is masked per document)."""
    make_hf_model("tiny").save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path, dtype=torch.float64)
    ids = torch.randint(0, TINY["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.tensor([[0] * 11 + [1] * 4 + [2] * 15, [3] * 30])
    positions = torch.cat([torch.arange(11), torch.arange(4), torch.arange(15)]).expand(1, -1)
    positions = torch.cat([positions, torch.arange(30)[None]])
    packed = native(ids, positions, Documents.from_document_ids(doc_ids))
    for row, spans in ((0, [(0, 11), (11, 15), (15, 30)]), (1, [(0, 30)])):
        for a, b in spans:
            alone = native(ids[row:row + 1, a:b])
            torch.testing.assert_close(packed[row:row + 1, a:b], alone, rtol=1e-10, atol=1e-10)
    assert (native(ids, positions) - packed).abs().max() > 1e-3  # without the documents they mix


def test_hf_weights_round_trip(tmp_path):
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path / "hf")
    native = openrecipes.from_hf(tmp_path / "hf")
    save_hf(native, tmp_path / "out")
    back = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    expected, got = hf_model.state_dict(), back.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    reread = openrecipes.from_hf(tmp_path / "out")
    for (name, a), (_, b) in zip(native.state_dict().items(), reread.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_registered_35b_a3b_is_transformers_documented_config():
    """transformers documents Qwen3_5MoeTextConfig's defaults as Qwen/Qwen3.5-35B-A3B's: the registered size reads
    from them (RoPE base and context the published model's), and counts the parameters transformers builds."""
    from openrecipes.models.qwen3_5_moe import Qwen35MoeConfig
    from openrecipes.models.registry import get_config

    defaults = transformers.Qwen3_5MoeTextConfig(rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                                  "partial_rotary_factor": 0.25},
                                                 max_position_embeddings=262_144)
    registered = get_config("qwen3.5-35b-a3b")
    assert Qwen35MoeConfig.from_hf_dict(defaults.to_dict()) == registered
    with torch.device("meta"):
        model = modeling.Qwen3_5MoeForCausalLM(defaults)
    assert sum(p.numel() for p in model.parameters()) == registered.total_params() == 34_660_610_688
