"""Trainer side: reader, data-parallel sharding, THD microbatches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrecipes.config.layout import LayoutConfig, rows_per_microbatch
from openrecipes.data.batching import (RowLoader, attention_sum_sq, global_batch_rows, load_rows,
                                       make_microbatch, shard_rows)

from tests.data.sft_data_helpers import read_rows


def test_reader_matches_parquet(tiny_rows: Path) -> None:
    dataset = load_rows(tiny_rows)
    rows = read_rows(tiny_rows)
    np.testing.assert_array_equal(dataset.input_ids, rows["input_ids"])
    np.testing.assert_array_equal(dataset.loss_mask, rows["loss_mask"])
    assert [dataset.doc_lens(i).tolist() for i in range(len(dataset))] == rows["doc_lens"]
    assert dataset.row_tokens == 256


def test_microbatch_positions_documents_and_cu_seqlens(tiny_rows: Path) -> None:
    dataset = load_rows(tiny_rows)
    rows = np.array([3, 0, 7])
    mb = make_microbatch(dataset, rows)
    B, T = 3, dataset.row_tokens
    assert mb["input_ids"].shape == (B, T) and mb["input_ids"].dtype == torch.int64
    assert mb["cu_seqlens"].dtype == torch.int32
    np.testing.assert_array_equal(mb["input_ids"].numpy(), dataset.input_ids[rows])
    np.testing.assert_array_equal(mb["loss_mask"].numpy(), dataset.loss_mask[rows])
    pos, doc = mb["position_ids"].numpy(), mb["document_ids"].numpy()
    for b in range(B):
        new_doc = np.r_[True, doc[b, 1:] != doc[b, :-1]]
        assert (pos[b][new_doc] == 0).all()  # positions restart at each document
        assert (pos[b][~new_doc] == pos[b][np.flatnonzero(~new_doc) - 1] + 1).all()
        assert doc[b, 0] == 0 and set(np.diff(doc[b])) <= {0, 1}
    # cu_seqlens: one segment per (row, document) over the flattened tokens
    flat_doc = (doc + np.arange(B)[:, None] * 10_000).reshape(-1)
    starts = np.flatnonzero(np.r_[True, flat_doc[1:] != flat_doc[:-1]])
    np.testing.assert_array_equal(mb["cu_seqlens"].numpy(), np.r_[starts, B * T])
    lengths = np.diff(mb["cu_seqlens"].numpy())
    assert int(mb["max_seqlen"]) == lengths.max()
    _, counts = np.unique(flat_doc, return_counts=True)
    assert attention_sum_sq(np.concatenate([dataset.doc_lens(int(r)) for r in rows])) == int((counts ** 2).sum())


def test_one_document_per_row_and_whole_rows(tiny_rows: Path) -> None:
    from dataclasses import replace

    from openrecipes.models.common.attention import Documents

    packed = load_rows(tiny_rows)
    assert any(packed.doc_lens(i).size > 1 for i in range(len(packed))) and not packed.one_document_per_row
    tokens = packed.row_tokens
    whole = replace(packed, doc_offsets=np.arange(len(packed) + 1, dtype=np.int64),
                    doc_lens_flat=np.full(len(packed), tokens, dtype=np.int32))
    assert whole.one_document_per_row
    for dataset, expected in ((whole, True), (packed, False)):
        mb = make_microbatch(dataset, np.array([0, 1]))
        documents = Documents.from_document_ids(mb["document_ids"])
        assert documents.whole_rows(2, tokens) is expected
        assert Documents(document_ids=mb["document_ids"], cu_seqlens=mb["cu_seqlens"],
                         max_seqlen=int(mb["max_seqlen"])).whole_rows(2, tokens) is expected


@pytest.mark.parametrize("dp_size", [1, 2, 4, 8])
def test_sharding_covers_each_global_batch_once(tiny_rows: Path, dp_size: int) -> None:
    dataset = load_rows(tiny_rows)
    for step in range(3):
        batch = global_batch_rows(step, 16, len(dataset))
        parts = [shard_rows(batch, r, dp_size) for r in range(dp_size)]
        assert sorted(np.concatenate(parts).tolist()) == sorted(batch.tolist())
        assert all(p.size == 16 // dp_size for p in parts)
        loaders = [RowLoader(dataset=dataset, global_batch=16, dp_rank=r, dp_size=dp_size,
                             rows_per_microbatch=rows_per_microbatch(LayoutConfig(max_tokens_per_gpu=512), dataset.row_tokens)) for r in range(dp_size)]
        seen = [row for loader in loaders
                for mb in loader.microbatches(step) for row in mb["input_ids"].numpy().tolist()]
        assert sorted(seen) == sorted(dataset.input_ids[batch].tolist())
    # consecutive steps read consecutive rows and wrap over epochs
    np.testing.assert_array_equal(global_batch_rows(1, 16, 20), (np.arange(16) + 16) % 20)
    with pytest.raises(ValueError, match="does not divide"):
        shard_rows(global_batch_rows(0, 6, len(dataset)), 0, 4)


def test_rows_per_microbatch_and_loader(tiny_rows: Path) -> None:
    assert rows_per_microbatch(LayoutConfig(max_tokens_per_gpu=16384), 8192) == 2
    assert rows_per_microbatch(LayoutConfig(max_tokens_per_gpu=8192), 8192) == 1
    assert rows_per_microbatch(LayoutConfig(max_tokens_per_gpu=1000), 8192) == 1
    dataset = load_rows(tiny_rows)
    loader = RowLoader(dataset=dataset, global_batch=8, dp_rank=1, dp_size=2, rows_per_microbatch=rows_per_microbatch(LayoutConfig(max_tokens_per_gpu=3 * 256), 256))
    mbs = loader.microbatches(0)
    assert [mb["input_ids"].shape[0] for mb in mbs] == [3, 1]  # 4 rows for this rank, 3 per microbatch
    with pytest.raises(ValueError):
        RowLoader(dataset=dataset, global_batch=8, dp_rank=2, dp_size=2, rows_per_microbatch=1)


def test_reader_rejects_bad_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0, 1, 1], [0, 1]], pa.list_(pa.int8())),
                      "doc_lens": pa.array([[3], [2]], pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match="not all"):
        load_rows(tmp_path / "rows.parquet")
