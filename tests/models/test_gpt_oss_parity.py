"""Native gpt-oss against transformers' GptOssForCausalLM (eager attention, which computes the sinks): same
weights, fp32, CPU; logits, loss and every gradient; the HF weight round trip; MXFP4 expert import."""

import json

import pytest
import torch

import openrecipes
from openrecipes.checkpoint.hf import from_hf, save_hf
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.families import family_for_model_type
from openrecipes.verify.parity import lm_loss, native_gradients

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gpt_oss")

# 2 layers (sliding, full), GQA 2:1, heads x head_dim (32) = hidden; window 4 over rows of 12 tokens
TINY = dict(vocab_size=99, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
TOKENS = 12
VARIANTS = {
    "tiny": {},  # transformers' default RoPE: YaRN, factor 32 over 4096 (truncate false)
    "window_3": dict(sliding_window=3),
    "all_full": dict(layer_types=["full_attention", "full_attention"]),
    "all_sliding_3_layers": dict(num_hidden_layers=3, layer_types=["sliding_attention"] * 3, sliding_window=2),
    "plain_rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # YaRN past its trained length (6 positions, 12 in the input), rounded ramp bounds
    "yarn_short": dict(max_position_embeddings=24, rope_parameters={
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 6,
        "beta_fast": 8.0, "beta_slow": 1.0, "truncate": True}),
    "top1": dict(num_experts_per_tok=1),
    "top_all": dict(num_experts_per_tok=4),
    "tight_clamp": dict(swiglu_limit=0.3, swiglu_alpha=1.1),  # most gates and ups clamped
    "no_attention_bias": dict(attention_bias=False),
    "rms_norm_eps_1e-2": dict(rms_norm_eps=1e-2),
    "mha_head_dim_12": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=12),
    "pad_token": dict(pad_token_id=3),
}


def make_hf_model(variant: str, seed: int = 0, std: float = 0.2):
    config = transformers.GptOssConfig(**{**TINY, **VARIANTS[variant]}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():  # far from uniform routing and attention; sinks and biases that matter
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else std * torch.randn_like(param))
        if model.config.pad_token_id is not None:
            model.model.embed_tokens.weight[model.config.pad_token_id].zero_()
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _inputs(vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    ids[:, TOKENS // 2] = 3  # the pad token of the pad_token variant
    return ids


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_loss_and_grads_match_transformers(variant, backend, tmp_path):
    hf_model = make_hf_model(variant)
    hf_model.save_pretrained(tmp_path)
    native = from_hf(tmp_path, dtype=torch.float32, kernels=KernelOptions(attention=backend))
    assert type(native).__name__ == "GptOssForCausalLM"
    input_ids = _inputs(TINY["vocab_size"])
    hf_logits, native_logits = hf_model(input_ids).logits, native(input_ids)
    assert rel_err(native_logits, hf_logits) <= 1e-5
    hf_loss, native_loss = lm_loss(hf_logits, input_ids), lm_loss(native_logits, input_ids)
    assert abs(native_loss.item() - hf_loss.item()) / abs(hf_loss.item()) <= 1e-5
    hf_loss.backward()
    native_loss.backward()
    expected = native_gradients(family_for_model_type("gpt_oss", source="test"), dict(hf_model.named_parameters()))
    names = [name for name, _ in native.named_parameters()]
    assert sorted(expected) == sorted(names)
    for name, param in native.named_parameters():
        if expected[name] is None or expected[name].abs().max() == 0:
            assert param.grad is None or param.grad.abs().max() == 0, name
            continue
        assert rel_err(param.grad, expected[name]) <= 1e-5, name


def test_the_parity_can_fail(tmp_path):
    """Swapping the interleaved gate and up columns, or dropping the sinks, gives other logits."""
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    input_ids = _inputs(TINY["vocab_size"])
    expected = hf_model(input_ids).logits
    experts = native.model.layers["0"].mlp.experts
    with torch.no_grad():
        experts.gate_proj.data, experts.up_proj.data = experts.up_proj.data.clone(), experts.gate_proj.data.clone()
    assert rel_err(native(input_ids), expected) > 1e-3
    native = openrecipes.from_hf(tmp_path)
    with torch.no_grad():
        native.model.layers["1"].self_attn.sinks.fill_(-1e4)  # exp(sink) = 0: no sink
    assert rel_err(native(input_ids), expected) > 1e-3


def test_hf_weights_round_trip_bitwise(tmp_path):
    hf_model = make_hf_model("tiny")
    hf_model.save_pretrained(tmp_path / "hf")
    native = openrecipes.from_hf(tmp_path / "hf")
    save_hf(native, tmp_path / "out")
    back = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    expected, got = hf_model.state_dict(), back.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    reread = openrecipes.from_hf(tmp_path / "out")
    assert reread.config == native.config
    for (name, a), (_, b) in zip(native.state_dict().items(), reread.state_dict().items()):
        assert torch.equal(a, b), name


def test_config_refusals_name_the_field(tmp_path):
    from openrecipes.models.gpt_oss import GptOssConfig

    raw = make_hf_model("tiny").config.to_dict()
    assert GptOssConfig.from_hf_dict(raw).rope_scaling.kind == "yarn"
    cases = {"output_router_logits": (True, "output_router_logits"), "tie_word_embeddings": (True, "tie_word"),
             "sliding_window": (None, "sliding_window"), "layer_types": (["full_attention"], "layer_types"),
             "rope_parameters": ({"rope_type": "longrope", "factor": 2.0}, "rope_type='longrope'"),
             "quantization_config": ({"quant_method": "fp8"}, "quantization_config"),
             "some_new_key": (1, "some_new_key")}
    for key, (value, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            GptOssConfig.from_hf_dict({**raw, key: value})


def test_absent_and_null_head_fields_read_as_transformers_reads_them():
    """A config.json without head_dim or num_key_value_heads takes GptOssConfig's class defaults (64, 8); null
    derives them (hidden_size / heads, the heads): both as transformers' own config reads the same dict (where
    transformers 5.x's strict fields refuse a null, the derived value is transformers 4.x's)."""
    import transformers
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    from openrecipes.models.gpt_oss import GptOssConfig

    raw = make_hf_model("tiny").config.to_dict()
    wide = {**raw, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64}
    for key in ("head_dim", "num_key_value_heads"):
        for value in ("absent", None):
            given = {k: v for k, v in wide.items() if k != key} if value == "absent" else {**wide, key: value}
            ours = GptOssConfig.from_hf_dict(given)
            try:
                theirs = transformers.GptOssConfig(**given)
                expected = theirs.head_dim, theirs.num_key_value_heads
            except StrictDataclassFieldValidationError:  # a strict field refuses null
                derived = {"head_dim": (wide["hidden_size"] // 16, 8), "num_key_value_heads": (64, 16)}
                expected = derived[key]
            assert (ours.head_dim, ours.num_key_value_heads) == expected, (key, value)


def test_the_published_configs_read_as_the_registered_sizes():
    """The keys of openai/gpt-oss-120b's config.json as published (only layers and experts differ for 20b)."""
    from openrecipes.models.gpt_oss import GptOssConfig
    from openrecipes.models.registry import get_config

    for name, layers, experts in (("gpt-oss-120b", 36, 128), ("gpt-oss-20b", 24, 32)):
        published = {
            "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
            "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
            "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
            "num_local_experts": experts, "output_router_logits": False, "pad_token_id": 199999,
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"},
            "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
            "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
            "vocab_size": 201088}
        assert GptOssConfig.from_hf_dict(published) == get_config(name)


# ---- MXFP4 ----

def _random_mxfp4(shape_out_in: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every FP4 code in both nibbles, and exponents around 127 (scale 1)."""
    generator = torch.Generator().manual_seed(seed)
    *prefix, rows, cols = shape_out_in
    blocks = torch.randint(0, 256, (*prefix, rows, cols // 32, 16), generator=generator, dtype=torch.int32)
    scales = torch.randint(117, 132, (*prefix, rows, cols // 32), generator=generator, dtype=torch.int32)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantization_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from openrecipes.models.common.mxfp4 import dequantize_mxfp4

    blocks, scales = _random_mxfp4((3, 10, 64), seed=0)
    blocks[0, 0, 0, :2] = torch.tensor([0x21, 0xF8], dtype=torch.uint8)  # known codes: 0.5, 1.0, -0.0, -6.0
    scales[0, 0, 0] = 129                                              # scale 4
    ours = dequantize_mxfp4(blocks, scales, dtype=dtype)
    assert ours[0, 0, :4].tolist() == [2.0, 4.0, -0.0, -24.0]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, in, out): transposed
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_mxfp4_experts_import_dequantized(tmp_path):
    """A checkpoint whose experts are MXFP4 blocks and scales computes what transformers does with its
    dequantization of them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = dict(TINY, hidden_size=64, intermediate_size=32, num_attention_heads=4, head_dim=16)
    hf_model = transformers.GptOssForCausalLM(
        transformers.GptOssConfig(**config, attn_implementation="eager")).float().eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    hf_model.save_pretrained(tmp_path)
    weights = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(weights)
    experts, ffn, hidden = config["num_local_experts"], config["intermediate_size"], config["hidden_size"]
    for layer in range(config["num_hidden_layers"]):
        base = f"model.layers.{layer}.mlp.experts"
        for index, (proj, shape) in enumerate((("gate_up_proj", (experts, 2 * ffn, hidden)),
                                               ("down_proj", (experts, hidden, ffn)))):
            blocks, scales = _random_mxfp4(shape, seed=10 * layer + index)
            scales.clamp_(max=121)  # small weights: values up to 6 · 2^-6
            del tensors[f"{base}.{proj}"]
            tensors[f"{base}.{proj}_blocks"], tensors[f"{base}.{proj}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(hf_model.model.layers[layer].mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, weights, metadata={"format": "pt"})
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    native = openrecipes.from_hf(tmp_path, dtype=torch.float32)
    input_ids = _inputs(TINY["vocab_size"])
    assert rel_err(native(input_ids), hf_model(input_ids).logits) <= 1e-5
