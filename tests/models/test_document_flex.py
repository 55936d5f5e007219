"""FlexAttention over packed documents: the block mask built from the documents' boundaries equals the dense mask
tile by tile, and the attention equals the FP64 reference (forward on CPU; the backward is in tests/gpu)."""

import pytest
import torch

from openrecipes.models.common.attention import Documents, attention, attention_mask
from openrecipes.models.common.document_flex import BLOCK, document_block_mask, document_index


def _documents(rows_of_lengths, ids_of=lambda i: i):  # every row's documents have the same ids: rows stay apart
    rows = [torch.cat([torch.full((n,), ids_of(i)) for i, n in enumerate(lengths)]) for lengths in rows_of_lengths]
    return Documents.from_document_ids(torch.stack(rows))


CASES = [  # rows of document lengths: tokens not a multiple of the tile, tiles wholly inside one document, tiny ones
    [[300, 200, 140, 5], [645]],
    [[128, 128, 256], [1, 511]],
    [[40] * 10],
]


@pytest.mark.parametrize("window", [None, 100, 300])
@pytest.mark.parametrize("lengths", CASES)
def test_block_mask_tiles_agree_with_the_dense_mask(lengths, window):
    documents = _documents(lengths)
    rows, tokens = documents.document_ids.shape
    block_mask = document_block_mask(document_index(documents, rows, tokens, torch.device("cpu")), window=window)
    dense = attention_mask(tokens, documents=documents, window=window, device=torch.device("cpu"))[:, 0]
    blocks = -(-tokens // BLOCK)
    padded = torch.zeros(rows, blocks * BLOCK, blocks * BLOCK, dtype=torch.bool)
    padded[:, :tokens, :tokens] = dense
    tiles = padded.view(rows, blocks, BLOCK, blocks, BLOCK)
    any_allowed, all_allowed = tiles.any(dim=(2, 4)), tiles.all(dim=(2, 4))
    for row in range(rows):
        for q_block in range(blocks):
            partial = set(block_mask.kv_indices[row, 0, q_block, :block_mask.kv_num_blocks[row, 0, q_block]].tolist())
            full = set(block_mask.full_kv_indices[row, 0, q_block,
                                                  :block_mask.full_kv_num_blocks[row, 0, q_block]].tolist())
            assert not partial & full
            for k_block in range(blocks):
                in_sequence = (q_block + 1) * BLOCK <= tokens and (k_block + 1) * BLOCK <= tokens
                if k_block in full:  # a full tile is one where every pair may attend
                    assert all_allowed[row, q_block, k_block] or not in_sequence
                if any_allowed[row, q_block, k_block]:  # no allowed pair is ever skipped
                    assert k_block in partial | full, (row, q_block, k_block)
                elif k_block in partial | full:
                    assert False, f"tile {q_block},{k_block} of row {row} has no allowed pair"


@pytest.mark.parametrize("window", [None, 150])
@pytest.mark.parametrize("lengths", CASES[:2])
def test_flex_forward_matches_the_fp64_reference(lengths, window):
    torch.manual_seed(0)
    documents = _documents(lengths, ids_of=lambda i: 7 * i + 3)
    rows, tokens = documents.document_ids.shape
    q, k, v = torch.randn(rows, 4, tokens, 16), torch.randn(rows, 2, tokens, 16), torch.randn(rows, 2, tokens, 16)
    flex = attention(q, k, v, scale=0.25, documents=documents, window=window, backend="flex")
    exact = attention(q.double(), k.double(), v.double(), scale=0.25, documents=documents, window=window,
                      backend="reference")
    torch.testing.assert_close(flex.double(), exact, rtol=1e-4, atol=1e-5)


def test_flex_is_a_recipe_choice_only_where_its_backward_runs():
    from openrecipes.config.kernel_names import ATTENTION_BACKENDS, backend_runs

    assert "flex" in ATTENTION_BACKENDS
    assert backend_runs("attention", "flex", cuda=True, bf16=True)
    assert not backend_runs("attention", "flex", cuda=False, bf16=False)
