"""gpt-oss pieces: attention sinks in the engine's attention, parameter counts against the built modules, the
planner shape, and the layouts the model refuses by name."""

import dataclasses

import pytest
import torch

from openrecipes.models.common.attention import Documents, attention
from openrecipes.models.families import family_for_config
from openrecipes.models.gpt_oss.model import GptOssForCausalLM, build_gpt_oss
from openrecipes.models.registry import get_config


def _qkv(seed: int = 0, rows: int = 2, heads: int = 4, kv_heads: int = 2, tokens: int = 10, dim: int = 8):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, tokens, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(rows, kv_heads, tokens, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(rows, kv_heads, tokens, dim, generator=generator, dtype=torch.float64)
    sinks = torch.randn(heads, generator=generator, dtype=torch.float64)
    return q, k, v, sinks


def _by_formula(q, k, v, sinks, *, window, documents):
    """Each query row written out: exp(score) / (exp(sink) + sum of exp(allowed scores))."""
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for t in range(q.shape[2]):
                keys = [s for s in range(t + 1) if (window is None or t - s < window)
                        and (documents is None or documents[b, s] == documents[b, t])]
                scores = torch.stack([q[b, h, t] @ k[b, h // groups, s] for s in keys]) / q.shape[-1] ** 0.5
                weights = scores.exp() / (sinks[h].exp() + scores.exp().sum())
                out[b, h, t] = sum(w * v[b, h // groups, s] for w, s in zip(weights, keys))
    return out


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_sinks_match_the_formula(backend, window, packed):
    q, k, v, sinks = _qkv()
    ids = torch.tensor([[0] * 4 + [1] * 6, [0] * 10]) if packed else None
    documents = Documents.from_document_ids(ids) if packed else None
    got = attention(q, k, v, scale=q.shape[-1] ** -0.5, documents=documents, window=window, backend=backend,
                    sinks=sinks)
    expected = _by_formula(q, k, v, sinks, window=window, documents=ids)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
    plain = attention(q, k, v, scale=q.shape[-1] ** -0.5, documents=documents, window=window, backend=backend)
    assert not torch.allclose(got, plain, atol=1e-3)  # the sinks take probability away: the check can fail


def test_sink_gradients_agree_between_backends():
    grads = {}
    for backend in ("reference", "sdpa"):
        q, k, v, sinks = (t.clone().requires_grad_() for t in _qkv(seed=1))
        attention(q, k, v, scale=0.3, window=4, backend=backend, sinks=sinks).square().sum().backward()
        grads[backend] = [t.grad for t in (q, k, v, sinks)]
    for ref, sdpa in zip(grads["reference"], grads["sdpa"]):
        assert torch.allclose(ref, sdpa, rtol=1e-10, atol=1e-12)
    assert grads["sdpa"][3].abs().max() > 0


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_flex_sinks_match_the_formula(window, packed):
    """FlexAttention's output scaled by sigmoid(logsumexp - sink) (its forward runs on CPU; its backward on CUDA)."""
    q, k, v, sinks = _qkv()
    ids = torch.tensor([[0] * 4 + [1] * 6, [0] * 10]) if packed else None
    documents = Documents.from_document_ids(ids) if packed else None
    got = attention(q, k, v, scale=q.shape[-1] ** -0.5, documents=documents, window=window, backend="flex",
                    sinks=sinks)
    assert torch.allclose(got, _by_formula(q, k, v, sinks, window=window, documents=ids), rtol=1e-10, atol=1e-12)


def test_the_logsumexp_rescale_has_the_sink_columns_gradients():
    """rescale_for_sinks over attention with a differentiable logsumexp (fp64, written out here) has the values and
    every gradient (q, k, v, sinks) of the reference's extra softmax column: the flex path's backward is this."""
    from openrecipes.models.common.attention import attention_mask
    from openrecipes.models.common.document_flex import rescale_for_sinks

    def by_logsumexp(q, k, v, sinks):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~attention_mask(q.shape[2], documents=None, window=4,
                                                                             device=q.device), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        return rescale_for_sinks(torch.softmax(scores, dim=-1) @ v, lse, sinks)

    grads = {}
    for name, function in (("reference", lambda q, k, v, s: attention(q, k, v, scale=0.3, window=4,
                                                                        backend="reference", sinks=s)),
                           ("logsumexp", by_logsumexp)):
        q, k, v, sinks = (t.clone().requires_grad_() for t in _qkv(seed=2))
        out = function(q, k, v, sinks)
        out.square().sum().backward()
        grads[name] = [out.detach(), *(t.grad for t in (q, k, v, sinks))]
    for ref, got in zip(grads["reference"], grads["logsumexp"]):
        assert torch.allclose(ref, got, rtol=1e-10, atol=1e-12)
    assert grads["logsumexp"][4].abs().max() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward runs on CUDA only")
def test_flex_sink_gradients_match_the_reference_on_cuda():
    grads = {}
    for backend in ("reference", "flex"):
        q, k, v, sinks = (t.float().cuda().clone().requires_grad_() for t in _qkv(seed=3, tokens=300, dim=16))
        attention(q, k, v, scale=0.25, window=100, backend=backend, sinks=sinks).square().sum().backward()
        grads[backend] = [t.grad for t in (q, k, v, sinks)]
    for ref, flex in zip(grads["reference"], grads["flex"]):
        assert torch.allclose(ref, flex, rtol=1e-4, atol=1e-5), (ref - flex).abs().max()


def test_varlen_refuses_sinks_by_name():
    q, k, v, sinks = _qkv()
    with pytest.raises(ValueError, match="'varlen' does not support attention sinks"):
        attention(q, k, v, scale=0.3, backend="varlen", sinks=sinks)


def test_a_parallel_backend_and_a_split_head_count_refuse_sinks():
    q, k, v, sinks = _qkv()
    with pytest.raises(ValueError, match="context parallelism"):
        attention(q, k, v, scale=0.3, backend=lambda *a, **kw: q, sinks=sinks)
    with pytest.raises(ValueError, match="tensor parallelism does not split sinks"):
        attention(q[:, :2], k[:, :1], v[:, :1], scale=0.3, backend="sdpa", sinks=sinks)


def _count_from_module(config) -> tuple[int, int]:
    """Counted from the module's parameters (meta device), apart from the config's formulas."""
    with torch.device("meta"):
        model = GptOssForCausalLM(config)
    total = active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if "embed_tokens" in name or "norm" in name:
            continue
        share = config.num_experts_per_tok / config.num_local_experts if ".experts." in name else 1
        active += int(param.numel() * share)
    return total, active


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "gpt-oss-20b", "gpt-oss-120b"])
def test_counts_agree_with_the_built_modules(name):
    config = get_config(name)
    assert _count_from_module(config) == (config.total_params(), config.active_params())
    no_bias = dataclasses.replace(config, attention_bias=False)
    assert _count_from_module(no_bias) == (no_bias.total_params(), no_bias.active_params())


def test_published_sizes():
    """OpenAI's model card: 20.91B total, 3.61B active; 116.83B total, 5.13B active."""
    assert round(get_config("gpt-oss-20b").total_params() / 1e9, 2) == 20.91
    assert round(get_config("gpt-oss-20b").active_params() / 1e9, 2) == 3.61
    assert round(get_config("gpt-oss-120b").total_params() / 1e9, 2) == 116.83
    assert round(get_config("gpt-oss-120b").active_params() / 1e9, 2) == 5.13


def test_the_planner_sees_each_layers_window():
    config = dataclasses.replace(get_config("gpt-oss-tiny"),
                                 layer_types=("full_attention", "sliding_attention", "sliding_attention",
                                              "full_attention"))
    shape = family_for_config(config).planner_shape(config, "tiny")
    assert shape.attention_windows == (None, 8, 8, None)
    assert shape.active_params == config.active_params() and shape.expert_params == config.expert_params()


def test_expert_parallelism_is_refused_by_name():
    model = build_gpt_oss(get_config("gpt-oss-tiny"))

    class OtherDispatcher:
        def __call__(self, x_TD, routing, experts):
            return x_TD

    model.model.layers["0"].mlp.token_dispatcher = OtherDispatcher()
    with pytest.raises(NotImplementedError, match="expert parallelism is not supported"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_layer_chunks_compose_to_the_whole_model():
    model = build_gpt_oss(get_config("gpt-oss-tiny"), seed=3)
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    h = model(ids, layers=range(0, 2))
    assert torch.allclose(model(h, layers=range(2, 4)), model(ids), atol=1e-6)


def test_the_model_through_flex_equals_it_through_sdpa():
    """gpt-oss-tiny (sliding and full layers, a window shorter than the rows) with kernels.attention flex: the same
    logits as sdpa on whole and packed rows (the forward; flex's backward runs on CUDA only)."""
    from openrecipes.models.common.kernels import KernelOptions

    ids = torch.randint(0, 1024, (2, 20), generator=torch.Generator().manual_seed(1))
    packed = Documents.from_document_ids(torch.tensor([[0] * 7 + [1] * 13, [0] * 20]))
    logits = {}
    for backend in ("sdpa", "flex"):
        model = build_gpt_oss(get_config("gpt-oss-tiny"), seed=4, kernels=KernelOptions(attention=backend))
        with torch.no_grad():
            logits[backend] = [model(ids), model(ids, documents=packed)]
    for sdpa, flex in zip(logits["sdpa"], logits["flex"]):
        assert torch.allclose(sdpa, flex, rtol=1e-5, atol=1e-5), (sdpa - flex).abs().max()
    assert not torch.allclose(logits["sdpa"][0], logits["sdpa"][1], atol=1e-3)  # the packed rows differ
