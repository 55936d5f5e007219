"""The gated delta rule's chunked form against its token-by-token reference (fp64, forward and backward), the
causal convolution, and packed documents computed as if alone."""

import pytest
import torch

from openrecipes.models.common.attention import Documents
from openrecipes.models.qwen3_5_moe.delta_rule import (DocumentBatch, causal_depthwise_conv,
                                                       gated_delta_rule_chunked, gated_delta_rule_recurrent,
                                                       l2_normalize)


def _inputs(rows, heads, tokens, key, value, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q = l2_normalize(rand(rows, heads, tokens, key)) / key ** 0.5
    k = l2_normalize(rand(rows, heads, tokens, key))
    v = rand(rows, heads, tokens, value)
    g = -torch.nn.functional.softplus(rand(rows, heads, tokens))  # log-decays <= 0
    beta = torch.sigmoid(rand(rows, heads, tokens))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("tokens, chunk", [(1, 4), (7, 4), (16, 4), (21, 8), (13, 64)])
def test_chunked_equals_recurrent_forward_and_backward(tokens, chunk):
    inputs = _inputs(2, 3, tokens, 5, 6)
    reference = gated_delta_rule_recurrent(*inputs)
    chunked = gated_delta_rule_chunked(*inputs, chunk=chunk)
    assert chunked.dtype == torch.float64
    torch.testing.assert_close(chunked, reference, rtol=1e-10, atol=1e-12)
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads_ref = torch.autograd.grad((reference * weights).sum(), inputs)
    grads = torch.autograd.grad((chunked * weights).sum(), inputs)
    for name, got, expected in zip("q k v g beta".split(), grads, grads_ref):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11, msg=name)


def test_the_comparison_can_fail():
    """Dropping the decay of one token changes the recurrent outputs: the comparison above sees g."""
    q, k, v, g, beta = _inputs(1, 2, 9, 4, 4)
    changed = g.detach().clone()
    changed[:, :, 4] = 0.0
    assert (gated_delta_rule_chunked(q, k, v, changed, beta, chunk=4)
            - gated_delta_rule_recurrent(q, k, v, g, beta)).abs().max() > 1e-3


def test_causal_conv_reads_only_the_past():
    x = torch.randn(2, 10, 6, dtype=torch.float64)
    weight = torch.randn(6, 1, 4, dtype=torch.float64)
    out = causal_depthwise_conv(x, weight)
    expected = torch.zeros_like(x)
    for t in range(10):
        for j in range(4):
            if t - j >= 0:
                expected[:, t] += weight[:, 0, 3 - j] * x[:, t - j]
    torch.testing.assert_close(out, expected)


def test_packed_documents_are_computed_as_if_alone():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 6, 6, 6]])
    documents = Documents.from_document_ids(ids)
    batch = DocumentBatch.build(documents)
    x = torch.randn(2, 10, 3, dtype=torch.float64)
    weight = torch.randn(3, 1, 4, dtype=torch.float64)
    packed = batch.scatter(causal_depthwise_conv(batch.gather(x), weight), 2, 10)
    for row in range(2):
        starts = [0] + [t for t in range(1, 10) if ids[row, t] != ids[row, t - 1]] + [10]
        for a, b in zip(starts, starts[1:]):
            alone = causal_depthwise_conv(x[row:row + 1, a:b], weight)
            torch.testing.assert_close(packed[row:row + 1, a:b], alone)
    # the same rows run whole mix the documents: the regrouping is what separates them
    assert (causal_depthwise_conv(x, weight) - packed).abs().max() > 1e-3
