"""Muse Spark model: counts on meta, fp32 tensors, router, attention paths, windows, documents, fp64 reference."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from openrecipes.models.common.attention import Documents
from openrecipes.models.common.router import SigmoidTopKRouter
from openrecipes.models.muse_spark.config import FULL, SLIDING, MuseSparkConfig
from openrecipes.models.muse_spark.model import MuseSparkForCausalLM, build_muse_spark, soft_cap
from openrecipes.models.registry import get_config

FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.expert_bias", "residual_gate.weight")


def packed(lengths_per_row):
    """document ids and per-document positions for rows of packed documents."""
    ids, pos = [], []
    for row, lengths in enumerate(lengths_per_row):
        ids.append(torch.cat([torch.full((n,), 10 * row + i) for i, n in enumerate(lengths)]))
        pos.append(torch.cat([torch.arange(n) for n in lengths]))
    return Documents.from_document_ids(torch.stack(ids)), torch.stack(pos)


def tiny(**change):
    return dataclasses.replace(get_config("muse-spark-tiny"), **change)


def test_full_config_counts_from_the_module_on_meta():
    config = get_config("muse-spark-open-816b-a42b")
    with torch.device("meta"):
        model = MuseSparkForCausalLM(config)
    trainable = frozen = active = 0
    for name, param in model.named_parameters():
        assert param.is_meta, name
        if not param.requires_grad:
            assert name.endswith("mlp.gate.expert_bias"), name
            frozen += param.numel()
            continue
        trainable += param.numel()
        if "embed_tokens" in name or "norm" in name or "residual_gate" in name:
            continue
        share = (config.num_experts_per_tok, config.num_experts) if ".experts." in name else (1, 1)
        active += param.numel() * share[0] // share[1]
    assert trainable == config.total_params()
    assert frozen == config.num_hidden_layers * config.num_experts
    assert active == config.active_params() == 44_432_883_712
    kinds = [layer.layer_type for layer in model.model.language_model.layers.values()]
    assert kinds == list(config.layer_types)


def test_fp32_tensors_stay_fp32_through_casts():
    model = build_muse_spark(get_config("muse-spark-tiny"), seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if name.endswith(FP32_SUFFIXES):
            assert param.dtype == torch.float32, name
            assert torch.equal(param, before[name]), name  # never rounded through bf16
        else:
            assert param.dtype == torch.bfloat16, name
    model.double()  # casting up is allowed (reference checks)
    assert model.model.language_model.layers["0"].mlp.gate.weight.dtype == torch.float64
    model.half()
    gate = model.model.language_model.layers["0"].mlp.gate.weight
    assert gate.dtype == torch.float32 and torch.equal(gate, before["model.language_model.layers.0.mlp.gate.weight"])
    built = build_muse_spark(get_config("muse-spark-tiny"), seed=1, dtype=torch.bfloat16)
    logits = built(torch.randint(0, 1024, (1, 8)))
    logits.float().sum().backward()
    assert built.model.language_model.layers["1"].attn_residual_gate.weight.grad.dtype == torch.float32
    assert built.model.language_model.layers["1"].mlp.gate.weight.grad.dtype == torch.float32
    assert built.model.language_model.layers["1"].mlp.gate.expert_bias.grad is None


def test_init_is_deterministic_per_tensor():
    a, b = build_muse_spark(tiny(), seed=5), build_muse_spark(tiny(), seed=5)
    c = build_muse_spark(tiny(), seed=6)
    layer = a.model.language_model.layers["2"]
    for name, param in a.named_parameters():
        assert torch.equal(param, dict(b.named_parameters())[name]), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.all(a.model.language_model.norm.weight == 0)  # zero-centered: stores w - 1
    assert torch.all(layer.mlp_residual_gate.weight == 1) and torch.all(layer.mlp.gate.expert_bias == 0)
    assert torch.all(layer.self_attn.o_norm.weight == 1) and torch.all(layer.mlp.pre_expert_norm.weight == 1)
    assert abs(layer.mlp.experts.up_proj.std().item() - 0.02) < 0.003


def test_router_bias_moves_selection_but_not_weights():
    torch.manual_seed(0)
    router = SigmoidTopKRouter(16, 6, 2)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.expert_bias.zero_()
    x = torch.randn(32, 16, requires_grad=True)
    plain = router(x)
    router.expert_bias.data[4] = 100.0  # forces expert 4 into every selection
    biased = router(x)
    assert (biased.experts_TK == 4).any(dim=-1).all() and not (plain.experts_TK == 4).any(dim=-1).all()
    scores = torch.sigmoid(x.detach() @ router.weight.detach().T)
    expected = scores.gather(-1, biased.experts_TK)
    torch.testing.assert_close(biased.weights_TK.detach(), expected / expected.sum(-1, keepdim=True))
    assert torch.allclose(biased.weights_TK.sum(-1), torch.ones(32))
    biased.weights_TK.sum().backward()
    assert router.expert_bias.grad is None and not router.expert_bias.requires_grad
    unnormalized = SigmoidTopKRouter(16, 6, 2, normalize_top_k=False)
    unnormalized.load_state_dict(router.state_dict())
    torch.testing.assert_close(unnormalized(x).weights_TK.detach(), expected)


def test_soft_cap_bounds_logits():
    x = torch.tensor([-1e4, -20.0, 0.0, 1e-3, 35.0, 1e4])
    torch.testing.assert_close(soft_cap(x, 20.0), 20.0 * torch.tanh(x / 20.0))
    model = build_muse_spark(tiny(), seed=0)
    model.lm_head.weight.data *= 1e4
    logits = model(torch.randint(0, 1024, (1, 6)))
    assert logits.abs().max() <= 20.0 and logits.abs().max() > 19.0


def test_sdpa_matches_reference_path_fp64_with_packed_documents():
    model = build_muse_spark(tiny(), seed=2).double()
    documents, positions = packed([[20, 9, 11], [40]])  # window 16: documents longer and shorter than it
    ids = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(0))
    model.set_attention_backend("sdpa")
    fast = model(ids, positions, documents)
    model.set_attention_backend("reference")  # dense fp32 scores with an explicit mask
    exact = model(ids, positions, documents)
    assert ((fast - exact).abs().max() / exact.abs().max()).item() < 1e-5


def same(a, b):
    """Equal up to fp64 rounding: expert GEMMs group tokens of other positions and a BLAS may round a row
    differently when the group size changes; any real dependence shows at ~1e-3 or more."""
    return torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_no_token_sees_another_document():
    model = build_muse_spark(tiny(), seed=3).double()
    documents, positions = packed([[12, 16, 12]])
    ids = torch.randint(0, 1024, (1, 40), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[0, :12] = (other[0, :12] + 7) % 1024      # document before
    other[0, 28:] = (other[0, 28:] + 11) % 1024     # document after
    base, changed = model(ids, positions, documents), model(other, positions, documents)
    assert same(base[0, 12:28], changed[0, 12:28])
    assert not same(base[0, :12], changed[0, :12])


@pytest.mark.parametrize("kind", [SLIDING, FULL])
def test_sliding_layer_sees_exactly_its_window(kind):
    window, probe = 4, 12
    model = build_muse_spark(tiny(num_hidden_layers=1, layer_types=(kind,), sliding_window=window), seed=4)
    model = model.double()
    ids = torch.randint(0, 1024, (1, 20), generator=torch.Generator().manual_seed(2))
    base = model(ids)[0, probe]

    def probe_after_changing(position):
        other = ids.clone()
        other[0, position] = (other[0, position] + 1) % 1024
        return model(other)[0, probe]

    assert same(base, probe_after_changing(probe + 1))                      # causal
    outside, inside = probe_after_changing(probe - window), probe_after_changing(probe - window + 1)
    assert not same(base, inside)
    assert same(base, outside) == (kind == SLIDING)  # full layers see the whole past


def test_stacked_sliding_layers_reach_layers_times_window():
    window, layers, probe = 3, 2, 15
    model = build_muse_spark(tiny(num_hidden_layers=layers, layer_types=(SLIDING,) * layers,
                                  sliding_window=window), seed=6).double()
    ids = torch.randint(0, 1024, (1, 20), generator=torch.Generator().manual_seed(3))
    reach = layers * (window - 1)
    base = model(ids)[0, probe]
    far, near = ids.clone(), ids.clone()
    far[0, : probe - reach] += 1
    near[0, probe - reach] += 1
    assert same(base, model(far)[0, probe])
    assert not same(base, model(near)[0, probe])


# ---- an independent per-token float64 reimplementation: explicit loops, masks and experts ----

def _rms(x, w, eps, centered=False):
    y = x / torch.sqrt(x.pow(2).mean() + eps)
    return y * (1.0 + w) if centered else y * w


def _rotate_adjacent(x, position, theta):
    dim = x.shape[-1]
    out = x.clone()
    for i in range(dim // 2):
        # fp32 angles, as the model computes them (rounding differences would dwarf the fp64 comparison)
        inv_freq = 1.0 / torch.tensor(theta, dtype=torch.float32) ** torch.tensor(2 * i / dim, dtype=torch.float32)
        angle = (torch.tensor(float(position), dtype=torch.float32) * inv_freq).double()
        a, b = x[2 * i], x[2 * i + 1]
        out[2 * i], out[2 * i + 1] = a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()
    return out


def reference_logits(model, ids, positions, document_ids):
    c, eps = model.config, model.config.rms_norm_eps
    P = {k: v.detach().double() for k, v in model.state_dict().items()}
    heads, kv_heads, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rows, tokens = ids.shape
    logits = torch.empty(rows, tokens, c.vocab_size, dtype=torch.float64)
    for b in range(rows):
        xs = [P["model.language_model.embed_tokens.weight"][ids[b, t]] for t in range(tokens)]
        for i, kind in enumerate(c.layer_types):
            w = lambda n: P[f"model.language_model.layers.{i}.{n}"]  # noqa: E731
            normed = [_rms(x, w("input_layernorm.weight"), eps) for x in xs]
            q, k, v = [], [], []
            for t, n in enumerate(normed):
                q_t = [_rms(h, w("self_attn.q_norm.weight"), eps) for h in (w("self_attn.q_proj.weight") @ n).view(heads, dh)]
                k_t = [_rms(h, w("self_attn.k_norm.weight"), eps) for h in (w("self_attn.k_proj.weight") @ n).view(kv_heads, dh)]
                if kind == SLIDING:
                    q_t = [_rotate_adjacent(h, positions[b, t], c.rope_theta) for h in q_t]
                    k_t = [_rotate_adjacent(h, positions[b, t], c.rope_theta) for h in k_t]
                q.append(q_t), k.append(k_t), v.append((w("self_attn.v_proj.weight") @ n).view(kv_heads, dh))
            new = []
            for t in range(tokens):
                seen = [s for s in range(t + 1) if document_ids[b, s] == document_ids[b, t]
                        and (kind == FULL or t - s < c.sliding_window)]
                outs = []
                for h in range(heads):
                    g = h // (heads // kv_heads)
                    scores = torch.stack([q[t][h] @ k[s][g] for s in seen]) / math.sqrt(dh)
                    probs = torch.softmax(scores, dim=0)
                    mixed = sum(p * v[s][g] for p, s in zip(probs, seen))
                    outs.append(_rms(mixed, w("self_attn.o_norm.weight"), eps))
                gated = torch.cat(outs) * torch.sigmoid(w("self_attn.output_gate_proj.weight") @ normed[t])
                h_t = xs[t] + w("attn_residual_gate.weight") * (w("self_attn.o_proj.weight") @ gated)
                m = _rms(h_t, w("post_attention_layernorm.weight"), eps)
                scores = torch.sigmoid(w("mlp.gate.weight") @ m)
                chosen = torch.topk(scores + w("mlp.gate.expert_bias"), c.num_experts_per_tok).indices.tolist()
                gates = scores[chosen] / scores[chosen].sum()
                z = _rms(w("mlp.latent_down_proj.weight") @ m, w("mlp.pre_expert_norm.weight"), eps)
                y = torch.zeros_like(z)
                for weight, e in zip(gates, chosen):
                    hidden = F.silu(w("mlp.experts.gate_proj")[e] @ z) * (w("mlp.experts.up_proj")[e] @ z)
                    y = y + weight * (w("mlp.experts.down_proj")[e] @ hidden)
                moe = w("mlp.latent_up_proj.weight") @ _rms(y, w("mlp.post_expert_norm.weight"), eps)
                new.append(h_t + w("mlp_residual_gate.weight") * moe)
            xs = new
        for t, x in enumerate(xs):
            final = _rms(x, P["model.language_model.norm.weight"], eps, centered=True)
            logits[b, t] = 20.0 * torch.tanh(P["lm_head.weight"] @ final / 20.0)
    return logits


def test_forward_matches_per_token_fp64_reference():
    model = build_muse_spark(tiny(), seed=7)
    with torch.no_grad():  # non-trivial values for the tensors that start at constants
        for name, param in model.named_parameters():
            if "norm" in name or "residual_gate" in name or "expert_bias" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    model = model.double()
    documents, positions = packed([[22, 14], [36]])
    ids = torch.randint(0, 1024, (2, 36), generator=torch.Generator().manual_seed(4))
    expected = reference_logits(model, ids, positions, documents.document_ids)
    got = model(ids, positions, documents)
    # RMSNorm computes in fp32 even for fp64 inputs, so agreement is at fp32 level, far below any wiring error
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    assert got.abs().max() < 20.0 and (expected - expected.mean()).abs().max() > 0.1


def test_config_json_round_trip_and_errors():
    config = tiny(norm_topk_prob=False)
    raw = config.to_hf_dict()
    assert raw["model_type"] == "muse_spark" and isinstance(raw["layer_types"], list)
    assert MuseSparkConfig.from_hf_dict(raw) == config
    nested = {"model_type": "muse_spark", "text_config": {k: v for k, v in raw.items() if k != "model_type"},
              "vision_config": {"depth": 50, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                "out_hidden_size": 48}, "image_token_id": 5, "video_token_id": 6}
    full = MuseSparkConfig.from_hf_dict(nested)
    assert full.vision.depth == 50 and full.text_only().vision is None
    assert dataclasses.replace(full, vision=None, image_token_id=None, video_token_id=None) == config
    with pytest.raises(ValueError, match="shared_expert_size"):
        MuseSparkConfig.from_hf_dict({**raw, "shared_expert_size": 3}, source="x/config.json")
    with pytest.raises(ValueError, match="model_type"):
        MuseSparkConfig.from_hf_dict({**raw, "model_type": "qwen3_moe"})
