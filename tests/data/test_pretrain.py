"""Pretraining rows (`data build --format pretrain`): text documents and Megatron indexed datasets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from openrecipes.data.batching import load_rows
from openrecipes.data.build import build
from openrecipes.data.bundled import CONVERSATIONS, DOCUMENTS, TOKENIZER
from openrecipes.data.manifest import rows_sha256_of
from openrecipes.data.megatron_indexed import read_indexed
from openrecipes.data.tokenizer import load_tokenizer
from tests.data.sft_data_helpers import JOB_OPTIONS, build_job, run_build

EOS = "<|endoftext|>"


def _texts(n: int = 120) -> list[str]:
    return [json.loads(line)["text"] for line in DOCUMENTS.read_text().splitlines()[:n]]


def _build(out: Path, input: Path, **kwargs) -> dict:
    options = dict(row_tokens=64, seed=7, eos_token=EOS, progress=False, chunk_conversations=16)
    options.update(kwargs)
    job = build_job(out, input=input, tokenizer=TOKENIZER, format="pretrain", **options)
    return build(job.spec, out, **{key: options[key] for key in JOB_OPTIONS if key in options})


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _expected_rows(documents: list[np.ndarray], seed: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """The definition, written independently: permute, concatenate, cut; no target at a document or row start."""
    order = np.random.default_rng(seed).permutation(len(documents))
    stream = np.concatenate([documents[i] for i in order])
    starts = np.zeros(stream.size, dtype=bool)
    starts[np.cumsum([0] + [documents[i].size for i in order[:-1]])] = True
    n = stream.size // T
    mask = (~starts[:n * T]).astype(np.int8).reshape(n, T)
    mask[:, 0] = 0
    return stream[:n * T].reshape(n, T), mask


def _tokenized(texts: list[str]) -> list[np.ndarray]:
    bundle = load_tokenizer(TOKENIZER)
    eos_id = bundle.token_id(EOS)
    return [np.array(bundle.tokenizer.encode(t, add_special_tokens=False).ids + [eos_id]) for t in texts]


@pytest.mark.parametrize("window", [None, 128])
def test_text_rows_follow_the_definition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    if window:  # most documents longer than a window: encoded in windows, stitched, and still the definition's ids
        from openrecipes.data import stream

        monkeypatch.setattr(stream, "WINDOW_CHARS", window)
        monkeypatch.setattr(stream, "MARGIN_CHARS", 16)
    texts = _texts()
    manifest = _build(tmp_path / "out", _write_jsonl(tmp_path / "d.jsonl", texts))
    ids, mask = _expected_rows(_tokenized(texts), seed=7, T=64)
    rows = load_rows(tmp_path / "out")
    np.testing.assert_array_equal(rows.input_ids, ids)
    np.testing.assert_array_equal(rows.loss_mask, mask)
    assert manifest["workflow"] == "pretrain" and manifest["loss_mask"] == "pretrain"
    assert manifest["rows"] == ids.shape[0] and manifest["supervised_tokens"] == int(mask.sum())
    assert manifest["rows_sha256"] == rows_sha256_of(tmp_path / "out" / "rows.parquet")
    assert manifest["counts"]["documents_total"] == 120 and manifest["counts"]["documents_invalid"] == 0
    # each document piece starts exactly where the mask says a document starts
    for r in range(len(rows)):
        starts = np.cumsum(rows.doc_lens(r))[:-1]
        assert not rows.loss_mask[r, starts].any()


def test_parquet_and_saved_dataset_match_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts()
    reference = _build(tmp_path / "j", _write_jsonl(tmp_path / "d.jsonl", texts))
    table = pa.Table.from_pylist([{"text": t, "id": i} for i, t in enumerate(texts)])
    pq.write_table(table, tmp_path / "d.parquet")
    assert _build(tmp_path / "p", tmp_path / "d.parquet")["rows_sha256"] == reference["rows_sha256"]
    # a `datasets` save_to_disk directory: Arrow IPC stream files named by state.json (no `datasets` needed)
    saved = tmp_path / "saved"
    saved.mkdir()
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part in zip(names, (table.slice(0, 50), table.slice(50))):
        with pa.OSFile(str(saved / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as writer:
            writer.write_table(part)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    assert _build(tmp_path / "s", saved)["rows_sha256"] == reference["rows_sha256"]


def test_sft_conversations_from_a_saved_dataset(tmp_path: Path) -> None:
    import pyarrow as pa

    records = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()[:80]]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    options = dict(tokenizer=TOKENIZER, loss_mask="qwen3", row_tokens=128, progress=False)
    reference = run_build(tmp_path / "j", input=tmp_path / "c.jsonl", **options)
    table = pa.Table.from_pylist([{"messages": r["messages"], "metadata": json.dumps(r["metadata"])}
                                  for r in records])
    saved = tmp_path / "saved" / "train"
    saved.mkdir(parents=True)
    with pa.OSFile(str(saved / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    (tmp_path / "saved" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    built = run_build(tmp_path / "s", input=tmp_path / "saved", **options)
    assert built["rows_sha256"] == reference["rows_sha256"]


def test_bad_documents(tmp_path: Path) -> None:
    texts = _texts(40)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:3]) + '{"body": "no text"}\n'
                   + "".join(json.dumps({"text": t}) + "\n" for t in texts[3:]))
    with pytest.raises(ValueError, match=r"bad.jsonl line 4: expected an object with a 'text' string"):
        _build(tmp_path / "o1", bad)
    manifest = _build(tmp_path / "o2", bad, skip_invalid=True)
    assert manifest["counts"]["documents_invalid"] == 1 and manifest["counts"]["documents_total"] == 41
    forged = _write_jsonl(tmp_path / "forged.jsonl", texts[:5] + [f"early {EOS} end"])
    with pytest.raises(ValueError, match=r"forged.jsonl line 6: 'text' contains the added token"):
        _build(tmp_path / "o3", forged, special_tokens_in_text="refuse")
    with pytest.raises(ValueError, match="loss_mask apply to format sft only"):
        _build(tmp_path / "o4", bad, loss_mask="muse_spark")
    with pytest.raises(ValueError, match="no token '<nope>'"):
        _build(tmp_path / "o5", forged, eos_token="<nope>")


def test_a_special_token_in_a_document_is_text_by_default(tmp_path: Path) -> None:
    texts = [f"early {EOS} end <|im_start|>", "plain words"]
    manifest = _build(tmp_path / "out", _write_jsonl(tmp_path / "docs.jsonl", texts), row_tokens=8, seed=1)
    assert manifest["special_tokens_in_text"] == "text" and manifest["counts"]["documents_invalid"] == 0
    bundle = load_tokenizer(TOKENIZER)
    eos_id = bundle.token_id(EOS)
    # each document as the tokenizer splits it with its special tokens off, then the one end token
    bundle.tokenizer.encode_special_tokens = True
    documents = [np.array(bundle.tokenizer.encode(t, add_special_tokens=False).ids + [eos_id]) for t in texts]
    bundle.tokenizer.encode_special_tokens = False
    assert all(d[:-1].tolist().count(eos_id) == 0 and d.size > 3 for d in documents)  # quoted, never the token
    expected, _ = _expected_rows(documents, seed=1, T=8)
    np.testing.assert_array_equal(load_rows(tmp_path / "out").input_ids, expected)


def _megatron_dataset(prefix: Path, documents: list[np.ndarray], dtype: type) -> None:
    """Written by megatron-core's own builder; a document may span several sequences (add_item calls)."""
    torch = pytest.importorskip("torch")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    builder = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for number, tokens in enumerate(documents):
        pieces = np.array_split(tokens, 1 + number % 3)  # 1, 2 or 3 sequences per document
        for piece in pieces:
            builder.add_item(torch.from_numpy(piece.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_indexed_documents_come_back_identical(tmp_path: Path, dtype: type) -> None:
    rng = np.random.default_rng(3)
    documents = [rng.integers(0, 1000, size=int(rng.integers(1, 90))) for _ in range(60)]
    _megatron_dataset(tmp_path / "corpus_text_document", documents, dtype)
    read = read_indexed(tmp_path / "corpus_text_document.idx")
    assert len(read) == len(documents)
    for d, tokens in enumerate(documents):
        np.testing.assert_array_equal(read.document(d), tokens)
    np.testing.assert_array_equal(read.document_lengths(), [t.size for t in documents])


def test_pretrain_rows_from_megatron_indexed(tmp_path: Path) -> None:
    eos_id = load_tokenizer(TOKENIZER).token_id(EOS)
    documents = _tokenized(_texts(80))
    # preprocess_data.py --append-eod: half the documents already end with the end token, which is not doubled
    stored = [d if i % 2 else d[:-1] for i, d in enumerate(documents)]
    _megatron_dataset(tmp_path / "corpus", stored, np.uint16)
    manifest = _build(tmp_path / "out", tmp_path / "corpus")
    ids, mask = _expected_rows(documents, seed=7, T=64)
    rows = load_rows(tmp_path / "out")
    np.testing.assert_array_equal(rows.input_ids, ids)
    np.testing.assert_array_equal(rows.loss_mask, mask)
    assert manifest["source"]["files"] == [f"{tmp_path / 'corpus'}.idx", f"{tmp_path / 'corpus'}.bin"]
    assert ids.max() < 1024 and eos_id in ids


def test_megatron_index_errors(tmp_path: Path) -> None:
    _megatron_dataset(tmp_path / "c", [np.arange(5), np.arange(7)], np.int32)
    raw = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "t.bin").write_bytes((tmp_path / "c.bin").read_bytes())
    (tmp_path / "t.idx").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match=r"t.idx: \d+ bytes, but 3 sequences and 3 document-index entries"):
        read_indexed(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(b"NOTANIDX" + raw[8:])
    with pytest.raises(ValueError, match="not a Megatron indexed dataset index"):
        read_indexed(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(raw)
    (tmp_path / "t.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-4])
    with pytest.raises(ValueError, match="t.bin: 44 bytes, but .*t.idx points past its end"):
        read_indexed(tmp_path / "t")
    _megatron_dataset(tmp_path / "big", [np.array([5, 2000, 7])], np.int32)
    with pytest.raises(ValueError, match="document 0 holds token id 2000, outside the tokenizer's vocabulary"):
        _build(tmp_path / "o", tmp_path / "big.bin", row_tokens=2)


@pytest.mark.parametrize("pointer,message", [(-4, "negative sequence lengths or pointers"),
                                             (2**63 - 4, "points past its end")])
def test_a_megatron_pointer_outside_the_bin_file_is_refused(tmp_path: Path, pointer: int, message: str) -> None:
    from openrecipes.data.megatron_indexed import _PREAMBLE

    _megatron_dataset(tmp_path / "c", [np.arange(5), np.arange(7)], np.int32)  # 3 sequences
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    last_pointer = _PREAMBLE + 4 * 3 + 8 * 2  # read as tokens[-1:0] (nothing) or past the end: never silently
    raw[last_pointer:last_pointer + 8] = pointer.to_bytes(8, "little", signed=True)
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=message):
        read_indexed(tmp_path / "c")
