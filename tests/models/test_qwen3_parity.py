"""Native Qwen3-MoE against transformers' Qwen3MoeForCausalLM: same weights, fp32, CPU."""

import json

import pytest
import torch
import torch.nn.functional as F

import openrecipes
from tests.models.hf_reference import (HF_SMALL_CONFIGS, TESTER_INPUT_SHAPE, TESTER_VARIANTS, make_hf_model,
                                       make_tester_model)

pytest.importorskip("transformers")


def lm_loss(logits, input_ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_grad(hf_model, native_name, config):
    """Gradient of an HF parameter in native layout (fused gate_up split into gate and up)."""
    params = dict(hf_model.named_parameters())
    if native_name.endswith("experts.gate_proj") or native_name.endswith("experts.up_proj"):
        fused = params[native_name.rsplit(".", 1)[0] + ".gate_up_proj"].grad
        ffn = config.moe_intermediate_size
        return fused[:, :ffn] if native_name.endswith("gate_proj") else fused[:, ffn:]
    return params[native_name].grad


@pytest.mark.parametrize("name", sorted(HF_SMALL_CONFIGS))
def test_logits_loss_and_grads_match_transformers(name, tmp_path):
    hf_model = make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path, dtype=torch.float32)

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, hf_model.config.vocab_size, (2, 24), generator=generator)
    if hf_model.config.pad_token_id is not None:  # the pad row must get no gradient on either side
        input_ids[:, 5] = hf_model.config.pad_token_id

    hf_logits = hf_model(input_ids).logits
    native_logits = native(input_ids)
    assert rel_err(native_logits, hf_logits) <= 1e-5

    hf_loss, native_loss = lm_loss(hf_logits, input_ids), lm_loss(native_logits, input_ids)
    assert abs(native_loss.item() - hf_loss.item()) / abs(hf_loss.item()) <= 1e-5
    hf_loss.backward()
    native_loss.backward()

    checked = 0
    for param_name, param in native.named_parameters():
        expected = hf_grad(hf_model, param_name, native.config)
        assert param.grad is not None, param_name
        if expected.abs().max() == 0:
            assert param.grad.abs().max() == 0, param_name
            continue
        assert rel_err(param.grad, expected) <= 1e-5, param_name
        checked += 1
    assert checked >= len(list(native.parameters())) - 2  # only unrouted experts may have zero gradients


def test_pad_token_row_gets_no_gradient(tmp_path):
    hf_model = make_hf_model("pad_token")
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    pad = native.config.pad_token_id
    assert pad == 5
    input_ids = torch.full((1, 8), pad)
    input_ids[0, ::2] = 7
    lm_loss(native(input_ids), input_ids).backward()
    lm_loss(hf_model(input_ids).logits, input_ids).backward()
    hf_grad_rows = hf_model.model.embed_tokens.weight.grad
    native_grad_rows = native.model.embed_tokens.weight.grad
    assert hf_grad_rows[pad].abs().max() == 0 and native_grad_rows[pad].abs().max() == 0
    assert native_grad_rows[7].abs().max() > 0


def test_config_without_norm_topk_prob_computes_as_transformers(tmp_path):
    hf_model = make_hf_model("wide_heads")  # saved with norm_topk_prob true: remove the key
    hf_model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["norm_topk_prob"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from transformers import Qwen3MoeForCausalLM

    reloaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    assert reloaded.config.norm_topk_prob is False
    native = openrecipes.from_hf(tmp_path)
    input_ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))
    assert rel_err(native(input_ids), reloaded(input_ids).logits) <= 1e-5


ZERO_GRADIENT = 1e-8


def parity_errors(hf_model, native, input_ids):
    """(logits, loss, {native parameter: gradient}) max-relative errors of ``native`` against ``hf_model``; the loss
    is transformers' own (labels = input ids)."""
    out = hf_model(input_ids, labels=input_ids)
    native_logits = native(input_ids)
    native_loss = lm_loss(native_logits, input_ids)
    errors = (rel_err(native_logits, out.logits), abs(native_loss.item() - out.loss.item()) / abs(out.loss.item()))
    out.loss.backward()
    native_loss.backward()
    grads = {}
    for name, param in native.named_parameters():
        expected = hf_grad(hf_model, name, native.config)
        # a gradient that is zero but for rounding (a renormalised top-1 weight is always 1, so the router's is
        # ~1e-10 on both sides) has no scale to be relative to: then both sides must be that small
        if expected.abs().max() <= ZERO_GRADIENT:
            grads[name] = 0.0 if param.grad.abs().max() <= ZERO_GRADIENT else float("inf")
        else:
            grads[name] = rel_err(param.grad, expected)
    return errors[0], errors[1], grads


@pytest.mark.parametrize("variant", list(TESTER_VARIANTS))
def test_transformers_tester_config_and_variants(variant, tmp_path):
    """transformers' own Qwen3-MoE tester configuration and variants of it, saved by transformers and loaded by
    openrecipes.from_hf: logits, loss and every gradient within 1e-5 (fp32). The pad token, when set, is in every
    row (its embedding row gets no gradient on either side)."""
    hf_model = make_tester_model(variant)
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path, dtype=torch.float32)
    input_ids = torch.randint(0, hf_model.config.vocab_size, TESTER_INPUT_SHAPE,
                              generator=torch.Generator().manual_seed(2))
    if hf_model.config.pad_token_id is not None:
        input_ids[:, 3] = hf_model.config.pad_token_id
    logits_error, loss_error, grad_errors = parity_errors(hf_model, native, input_ids)
    assert logits_error <= 1e-5 and loss_error <= 1e-5
    worst = max(grad_errors, key=grad_errors.get)
    assert grad_errors[worst] <= 1e-5, (worst, grad_errors[worst])
    assert len(grad_errors) == len(list(native.parameters()))


def test_position_ids_match_transformers(tmp_path):
    hf_model = make_hf_model("wide_heads")
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    input_ids = torch.randint(0, 160, (1, 16))
    position_ids = torch.arange(100, 116)[None]
    expected = hf_model(input_ids, position_ids=position_ids).logits
    assert rel_err(native(input_ids, position_ids=position_ids), expected) <= 1e-5


@pytest.mark.parametrize("rope_style", ["rope_theta (transformers 4.x)", "rope_parameters (transformers 5.x)"])
def test_both_config_styles_load(tmp_path, rope_style):
    hf_model = make_hf_model("wide_heads")
    hf_model.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    theta = 12345.0
    raw.pop("rope_parameters", None)
    raw.pop("rope_theta", None)
    if rope_style.startswith("rope_theta"):
        raw.update(rope_theta=theta, num_experts=raw.pop("num_local_experts", raw.get("num_experts")),
                   transformers_version="4.51.0", rope_scaling=None)
    else:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config_path.write_text(json.dumps(raw))
    native = openrecipes.from_hf(tmp_path)
    assert native.config.rope_theta == theta
    assert native.config.num_experts == 8


def test_layer_options_out_of_range_are_refused_by_name(tmp_path):
    from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig

    base = dict(HF_SMALL_CONFIGS["wide_heads"], model_type="qwen3_moe")
    with pytest.raises(ValueError, match=r"mlp_only_layers \[2\] are not layers of this model \(0\.\.1\)"):
        Qwen3MoeConfig.from_hf_dict(dict(base, mlp_only_layers=[0, 2]))
    with pytest.raises(ValueError, match="'decoder_sparse_step' must be positive"):
        Qwen3MoeConfig.from_hf_dict(dict(base, decoder_sparse_step=0))
    with pytest.raises(ValueError, match="'sliding_window' must be positive"):
        Qwen3MoeConfig.from_hf_dict(dict(base, use_sliding_window=True, sliding_window=0))
    with pytest.raises(ValueError, match="use_sliding_window must be true or false"):
        Qwen3MoeConfig.from_hf_dict(dict(base, use_sliding_window="yes", sliding_window=8))
    with pytest.raises(ValueError, match="layer_types"):
        Qwen3MoeConfig.from_hf_dict(dict(base, layer_types=["sliding_attention", "full_attention"]))
    window = Qwen3MoeConfig.from_hf_dict(dict(base, use_sliding_window=True))  # transformers' default window
    assert window.sliding_window == 4096 and window.to_hf_dict()["use_sliding_window"] is True
    with pytest.raises(ValueError, match="not_a_field"):
        Qwen3MoeConfig.from_hf_dict(dict(base, not_a_field=1))
    with pytest.raises(ValueError, match="rope_type"):
        Qwen3MoeConfig.from_hf_dict(dict(base, rope_parameters={"rope_type": "yarn", "factor": 4.0}))


def test_bf16_load_keeps_values(tmp_path):
    hf_model = make_hf_model("wide_heads")
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in native.parameters())
    q = dict(hf_model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(native.model.layers["0"].self_attn.q_proj.weight, q.to(torch.bfloat16))


@pytest.mark.parametrize("model_name", ["qwen3-moe-tiny", "muse-spark-tiny"])
def test_pad_row_starts_at_zero_and_gets_no_gradient(model_name):
    import dataclasses

    from openrecipes.models.families import family_for_config
    from openrecipes.models.registry import get_config

    config = dataclasses.replace(get_config(model_name), pad_token_id=3)
    model = family_for_config(config).build(config, seed=0)
    embedding = next(m for n, m in model.named_modules() if n.endswith("embed_tokens"))
    assert embedding.weight[3].abs().max() == 0 and embedding.weight[4].abs().max() > 0
    input_ids = torch.tensor([[3, 4, 3, 5, 6, 3]])
    lm_loss(model(input_ids), input_ids).backward()
    assert embedding.weight.grad[3].abs().max() == 0 and embedding.weight.grad[4].abs().max() > 0


@pytest.mark.parametrize("right_padding", [0, 5])
def test_router_aux_loss_matches_transformers(tmp_path, right_padding):
    """loss = cross entropy + router_aux_loss_coef * load-balancing loss, with every gradient, against transformers'
    forward with labels and output_router_logits; a right-padded attention mask leaves the other tokens' routing
    unchanged, so it tests the masked form too."""
    from openrecipes.models.common.router_loss import RouterStatistics

    hf_model = make_hf_model("wide_heads", output_router_logits=True, router_aux_loss_coef=0.3)
    hf_model.save_pretrained(tmp_path)
    native = openrecipes.from_hf(tmp_path)
    assert native.config.output_router_logits and native.config.router_aux_loss_coef == 0.3
    input_ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(input_ids)
    if right_padding:
        mask[0, -right_padding:] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    out = hf_model(input_ids, attention_mask=mask if right_padding else None, labels=labels)
    with RouterStatistics(native, token_mask=mask if right_padding else None) as routing:
        logits = native(input_ids)
    aux = routing.load_balancing_loss()
    assert abs(aux.item() - out.aux_loss.item()) <= 1e-6 * out.aux_loss.item()
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    loss = ce + native.config.router_aux_loss_coef * aux
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
    assert aux.grad_fn is not None  # the router weights get the aux term's gradient, compared below
    out.loss.backward()
    loss.backward()
    for name, param in native.named_parameters():
        expected = hf_grad(hf_model, name, native.config)
        if expected.abs().max() > 0:
            assert rel_err(param.grad, expected) <= 1e-5, name


def test_per_row_aux_loss_is_transformers_loss_on_each_row(tmp_path):
    from openrecipes.models.common.router_loss import RouterStatistics

    hf_model = make_hf_model("unnormalized_topk", output_router_logits=True)
    native = openrecipes.from_hf(_saved(hf_model, tmp_path))
    input_ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(4))
    with RouterStatistics(native, rows=3) as routing:
        native(input_ids)
    expected = torch.stack([hf_model(input_ids[r:r + 1]).aux_loss for r in range(3)])
    assert rel_err(routing.losses(), expected) <= 1e-6
    assert rel_err(routing.load_balancing_loss(), expected.mean()) <= 1e-6


def _saved(hf_model, path):
    hf_model.save_pretrained(path)
    return path


def test_router_statistics_are_gathered_only_inside_the_with():
    from openrecipes.models.common.router_loss import RouterStatistics
    from openrecipes.models.registry import get_config
    from openrecipes.models.qwen3_moe import build_qwen3_moe

    model = build_qwen3_moe(get_config("qwen3-moe-tiny"))
    input_ids = torch.randint(0, 1024, (1, 8))
    routing = RouterStatistics(model)
    with routing:
        model(input_ids)
    model(input_ids)
    assert routing.layers == 4 and all(m.statistics is None for m in routing.routers)
    with pytest.raises(ValueError, match="no routing was recorded"):
        RouterStatistics(model).load_balancing_loss()
