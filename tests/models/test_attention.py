"""Attention backends agree, and packed documents never see each other."""

import pytest
import torch

from openrecipes.models.common.attention import Documents, attention, attention_mask
from openrecipes.models.common.rope import apply_rope, rope_angles
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config


def packed_ids(lengths, rows=1):
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return ids[None].expand(rows, -1).clone()


def test_documents_offsets():
    docs = Documents.from_document_ids(torch.tensor([[0, 0, 1, 1, 1], [7, 8, 8, 8, 8]]))
    assert docs.cu_seqlens.tolist() == [0, 2, 5, 6, 10]
    assert docs.max_seqlen == 4


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_matches_fp64_reference(window, packed):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    documents = Documents.from_document_ids(packed_ids([5, 4, 3], rows=2)) if packed else None
    fast = attention(q, k, v, scale=0.3, documents=documents, window=window, backend="sdpa")
    exact = attention(q.double(), k.double(), v.double(), scale=0.3, documents=documents, window=window,
                      backend="reference")
    torch.testing.assert_close(fast.double(), exact, rtol=1e-5, atol=1e-6)


def test_mask_respects_window_and_documents():
    docs = Documents.from_document_ids(packed_ids([4, 4]))
    mask = attention_mask(8, documents=docs, window=2, device=torch.device("cpu"))[0, 0]
    assert mask[3, 2] and mask[3, 3] and not mask[3, 1]      # window of 2 tokens, itself included
    assert not mask[4, 3] and mask[5, 4]                     # no attention across the document boundary
    assert not mask[2, 3]                                    # causal


def test_rope_pairings_rotate_by_position():
    x = torch.randn(1, 1, 3, 4)
    angles = rope_angles(torch.arange(3)[None], 4, 10_000.0)
    for pairing in ("half", "adjacent"):
        rotated = apply_rope(x, angles, pairing=pairing)
        torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])               # position 0: unchanged
        torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))        # a rotation keeps norms


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_attention_output_of_one_document_ignores_the_other_bitwise(backend):
    torch.manual_seed(0)
    lengths = [6, 10]
    documents = Documents.from_document_ids(packed_ids(lengths))
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    out = attention(q, k, v, scale=0.35, documents=documents, backend=backend)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :6] += 5.0
    v2[:, :, :6] -= 3.0
    out2 = attention(q, k2, v2, scale=0.35, documents=documents, backend=backend)
    assert not torch.equal(out[:, :, :6], out2[:, :, :6])
    assert torch.equal(out[:, :, 6:], out2[:, :, 6:])


def test_changing_one_document_leaves_the_other_unchanged():
    # Attention itself is bitwise isolated (test above). Through the whole model, the expert GEMMs group tokens
    # of both documents, and a BLAS may round a row differently when the group size changes, so the model-level
    # check is fp64 at 1e-12: a leak across documents would be ~1e-2, rounding noise is ~1e-16.
    model = build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=0).double()
    lengths = [10, 14]
    documents = Documents.from_document_ids(packed_ids(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    input_ids = torch.randint(0, 1024, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    changed = input_ids.clone()
    changed[0, :10] = torch.randint(0, 1024, (10,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = model(input_ids, position_ids, documents)
        b = model(changed, position_ids, documents)
        alone = model(input_ids[:, 10:], position_ids[:, 10:])  # document B alone, at the start of a row
    assert not torch.allclose(a[0, :10], b[0, :10], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(b[0, 10:], a[0, 10:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alone[0], a[0, 10:], rtol=1e-10, atol=1e-12)


def _varlen_bottom_right(q_THD, k_THD, v_THD, cu_q, cu_k, *, scale, window):
    """What flash varlen attention computes (causal, aligned to the bottom right), one sequence at a time."""
    out = torch.zeros_like(q_THD)
    for i in range(len(cu_q) - 1):
        q = q_THD[cu_q[i]:cu_q[i + 1]].transpose(0, 1)
        k, v = (x[cu_k[i]:cu_k[i + 1]].transpose(0, 1) for x in (k_THD, v_THD))
        if q.shape[1] == 0:
            continue
        k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], dim=0) for x in (k, v))
        shift = k.shape[1] - q.shape[1]
        query, key = torch.arange(q.shape[1])[:, None] + shift, torch.arange(k.shape[1])[None]
        allowed = (key <= query) & ((query - key < window) if window else True)
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
        out[cu_q[i]:cu_q[i + 1]] = (torch.softmax(scores, -1) @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_query_slice_offsets_give_the_rows_masks(window):
    # context parallelism's varlen offsets (CUDA path) against the masked slice attention, the varlen kernel played
    # by a per-sequence reference: documents straddling the slice edges, wholly before and wholly after it
    from openrecipes.models.common.attention import QuerySlice, sliced_query_attention

    torch.manual_seed(0)
    rows, tokens, part = 2, 16, 4
    q, k, v = (torch.randn(rows, h, tokens, 8, dtype=torch.float64) for h in (4, 2, 2))
    documents = Documents.from_document_ids(torch.stack([packed_ids([3, 6, 2, 5])[0], packed_ids([9, 7])[0]]))
    for offset in range(0, tokens, part):
        q_part = q[:, :, offset:offset + part]
        expected = sliced_query_attention(q_part, k, v, scale=0.3, query_offset=offset, documents=documents,
                                          window=window)
        layout = QuerySlice.build(documents, tokens=tokens, query_offset=offset, query_tokens=part)
        assert layout.key_tokens == offset + part
        assert int((layout.cu_q[1:] - layout.cu_q[:-1]).max()) <= layout.max_q
        assert int((layout.cu_k[1:] - layout.cu_k[:-1]).max()) <= layout.max_k
        to_thd = lambda x: x.transpose(1, 2).reshape(-1, x.shape[1], 8)  # noqa: E731
        got = _varlen_bottom_right(to_thd(q_part), to_thd(k[:, :, :offset + part]), to_thd(v[:, :, :offset + part]),
                                   layout.cu_q.tolist(), layout.cu_k.tolist(), scale=0.3, window=window)
        torch.testing.assert_close(got.reshape(rows, part, 4, 8).transpose(1, 2), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [None, 3])
def test_query_slices_over_whole_keys_equal_slices_of_full_attention(window):
    from openrecipes.models.common.attention import sliced_query_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 8, dtype=torch.float64), torch.randn(2, 2, 12, 8, dtype=torch.float64),
               torch.randn(2, 2, 12, 8, dtype=torch.float64))
    documents = Documents.from_document_ids(packed_ids([5, 4, 3], rows=2))
    full = attention(q, k, v, scale=0.3, documents=documents, window=window, backend="reference")
    for offset in (0, 4, 8):
        part = sliced_query_attention(q[:, :, offset:offset + 4], k, v, scale=0.3, query_offset=offset,
                                      documents=documents, window=window)
        torch.testing.assert_close(part, full[:, :, offset:offset + 4], rtol=1e-12, atol=1e-12)
