"""Fast CUDA paths against the exact references (skipped without CUDA)."""

import pytest
import torch

from openrecipes.models.common.attention import Documents, attention
from openrecipes.models.common.moe import GroupedExperts

pytestmark = pytest.mark.gpu


def test_grouped_mm_matches_loop_in_bf16():
    torch.manual_seed(0)
    experts = GroupedExperts(8, 256, 128).cuda().to(torch.bfloat16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    counts = torch.tensor([0, 37, 5, 128, 0, 64, 1, 21], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    experts.backend = "grouped_mm"
    fast = experts(x, counts).float()
    experts.backend = "loop"
    exact = experts(x, counts).float()
    assert ((fast - exact).norm() / exact.norm()).item() < 1e-2


@pytest.mark.parametrize("window", [None, 64])
def test_varlen_matches_reference_for_packed_documents(window):
    torch.manual_seed(0)
    rows, tokens, heads, kv_heads, dim = 2, 512, 8, 2, 64
    q = torch.randn(rows, heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(rows, kv_heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    lengths = [100, 300, 112]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    documents = Documents.from_document_ids(torch.stack([doc_ids, doc_ids + 10]).cuda())
    fast = attention(q, k, v, scale=dim ** -0.5, documents=documents, window=window, backend="varlen")
    exact = attention(q, k, v, scale=dim ** -0.5, documents=documents, window=window, backend="reference")
    assert ((fast.float() - exact.float()).norm() / exact.float().norm()).item() < 1e-2


@pytest.mark.parametrize("window", [None, 64])
def test_context_parallel_varlen_slices_match_masked_attention_with_gradients(window):
    # each cp rank's queries over the keys up to its slice's end, documents before, across and after the slice edges;
    # the key gradients also check that keys with no query in the slice (documents wholly before it) get zeros
    from openrecipes.models.common.attention import QuerySlice, sliced_query_attention, sliced_query_varlen

    torch.manual_seed(0)
    rows, tokens, heads, kv_heads, dim, part = 2, 512, 8, 2, 64, 128
    lengths = [[100, 300, 112], [40, 200, 150, 122]]
    ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths]).cuda()
    documents = Documents.from_document_ids(ids)
    q, k, v = (torch.randn(rows, h, tokens, dim, device="cuda", dtype=torch.bfloat16) for h in (heads, kv_heads,
                                                                                                  kv_heads))
    for offset in range(0, tokens, part):
        inputs = [t.detach().clone().requires_grad_() for t in (q[:, :, offset:offset + part], k, v)]
        exact_inputs = [t.detach().float().requires_grad_() for t in inputs]
        layout = QuerySlice.build(documents, tokens=tokens, query_offset=offset, query_tokens=part)
        fast = sliced_query_varlen(*inputs, scale=dim ** -0.5, query_slice=layout, window=window)
        exact = sliced_query_attention(*exact_inputs, scale=dim ** -0.5, query_offset=offset, documents=documents,
                                       window=window)
        grad = torch.randn_like(exact)
        fast.backward(grad.to(fast.dtype))
        exact.backward(grad)
        for a, b in [(fast, exact)] + [(x.grad, y.grad) for x, y in zip(inputs, exact_inputs)]:
            assert ((a.float() - b).norm() / b.norm()).item() < 1e-2, offset


@pytest.mark.parametrize("window", [None, 200])
def test_flex_matches_reference_with_gradients_for_packed_documents(window):
    torch.manual_seed(0)
    rows, tokens, heads, kv_heads, dim = 2, 1000, 8, 2, 64
    lengths = [130, 600, 14, 256]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    documents = Documents.from_document_ids(torch.stack([doc_ids, doc_ids + 10]).cuda())
    leaves = [torch.randn(rows, h, tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for h in (heads, kv_heads, kv_heads)]
    grad_out = torch.randn(rows, heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in ("flex", "reference"):
        out = attention(*leaves, scale=dim ** -0.5, documents=documents, window=window, backend=backend)
        results[backend] = [out.float()] + [g.float() for g in torch.autograd.grad(out, leaves, grad_out)]
    for fast, exact in zip(results["flex"], results["reference"]):
        assert ((fast - exact).norm() / exact.norm()).item() < 1e-2
