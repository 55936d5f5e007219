"""Image-text rows: image parts become the chat format's image tokens (one placeholder per merged patch, never
supervised), rows record the images they hold, the manifest's hashes cover the image bytes, bad images are named."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from openrecipes.data import bundled
from tests.data.sft_data_helpers import read_rows, run_build, write_jsonl

PIL = pytest.importorskip("PIL.Image")


def _image(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> Path:
    PIL.new("RGB", size, colour).save(path)
    return path


def _records(tmp_path: Path) -> list[dict]:
    _image(tmp_path / "a.png", (32, 32), (200, 0, 0))
    _image(tmp_path / "b.png", (48, 32), (0, 0, 200))
    (tmp_path / "sub").mkdir()
    _image(tmp_path / "sub" / "c.png", (40, 56), (0, 150, 0))
    image = lambda name: {"type": "image", "image": name}  # noqa: E731
    text = lambda value: {"type": "text", "text": value}  # noqa: E731
    return [
        {"messages": [{"role": "user", "content": [image("a.png"), text("What is this?")]},
                      {"role": "assistant", "content": "A red square."}]},
        # the quoted <|image_pad|> is text (the conversation's own special token), never an image token
        {"messages": [{"role": "user", "content": [text("Compare <|image_pad|> "), image("b.png"), text(" and "),
                                                   image(str(tmp_path / "sub" / "c.png"))]},
                      {"role": "assistant", "content": [text("Here: "), image("a.png"), text(" is red.")]}]},
        {"messages": [{"role": "user", "content": "Plain text, no image."},
                      {"role": "assistant", "content": "Plain answer."}]},
    ]


def _build(tmp_path: Path, records: list[dict], **options):
    source = write_jsonl(tmp_path / "chat.jsonl", records)
    return run_build(tmp_path / "out", input=source, tokenizer=bundled.VL_TOKENIZER,
                     **{"image_processor": bundled.IMAGE_PROCESSOR, **options})


def test_image_tokens_rows_and_hashes(tmp_path):
    import pyarrow.parquet as pq

    from openrecipes.data.images import ImageProcessorConfig, preprocess_images
    from openrecipes.data.tokenizer import load_tokenizer

    manifest = _build(tmp_path, _records(tmp_path) * 3, row_tokens=64, seed=1)
    out = tmp_path / "out"
    rows = read_rows(out)
    vocab = load_tokenizer(bundled.VL_TOKENIZER)
    pad, start, end = (vocab.token_id(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    ids, mask = rows["input_ids"], rows["loss_mask"]
    assert manifest["images"]["image_token_id"] == pad
    assert not mask[ids == pad].any(), "an image token is supervised"
    assert mask.any()

    # tokens per image from the image processor itself (data/images.py): grid_h * grid_w / merge^2
    processor = ImageProcessorConfig.from_hf_json(bundled.IMAGE_PROCESSOR)
    expected = {}
    for path in (tmp_path / "a.png", tmp_path / "b.png", tmp_path / "sub" / "c.png"):
        _, grid = preprocess_images([PIL.open(path)], processor)
        expected[hashlib.sha256(path.read_bytes()).hexdigest()] = int(grid[0].prod()) // processor.merge_size ** 2
    sidecar = pq.read_table(out / "images.parquet").to_pylist()
    held = []
    for entry in sidecar:
        row, first, count = entry["row"], entry["start"], entry["tokens"]
        assert (ids[row, first:first + count] == pad).all()
        assert expected[entry["sha256"]] == entry["grid_h"] * entry["grid_w"] // 4
        if first > 0:
            assert ids[row, first - 1] == start and entry["first"] == 0  # not cut at the start: the whole image
        if first + count < ids.shape[1]:
            assert ids[row, first + count] == end
            assert entry["first"] + count == expected[entry["sha256"]]
        held.append(count)
    assert sum(held) == int((ids == pad).sum()) == manifest["images"]["image_tokens"]
    assert any(entry["first"] > 0 for entry in sidecar), "a row boundary cuts an image (64-token rows)"

    # the files are the input images under their sha256, and the manifest's hash covers them and the placements
    files = sorted(p.name for p in (out / "images").iterdir())
    assert files == sorted({e["sha256"] for e in sidecar}) and set(files) <= set(expected)
    for name in files:
        assert hashlib.sha256((out / "images" / name).read_bytes()).hexdigest() == name
    digest = hashlib.sha256()
    for e in sidecar:
        digest.update(np.array([e[k] for k in ("row", "start", "tokens", "first", "grid_h", "grid_w")],
                               "<i4").tobytes())
        digest.update(bytes.fromhex(e["sha256"]))
    assert manifest["images"]["placements_sha256"] == digest.hexdigest()
    assert json.loads((out / "manifest.json").read_text())["images"]["sidecar_sha256"] == \
        hashlib.sha256((out / "images.parquet").read_bytes()).hexdigest()


def test_the_trainer_checks_the_images_it_reads(tmp_path):
    """load_rows reads the sidecar and checks every image file's bytes against its sha256 name."""
    from openrecipes.data.batching import load_rows, make_microbatch

    _build(tmp_path, _records(tmp_path) * 3, row_tokens=64, seed=1)
    out = tmp_path / "out"
    dataset = load_rows(out)
    rows = np.flatnonzero(np.diff(dataset.images.row_offsets) > 0)[:2]
    batch = make_microbatch(dataset, rows)
    held = batch["image_tokens_held"]
    assert int(held[:, 1].sum()) == int((batch["input_ids"] == dataset.images.image_token_id).sum())
    victim = next((out / "images").iterdir())
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(ValueError, match=f"{victim.name}: missing or its bytes do not match its sha256 name"):
        load_rows(out)


def test_text_rows_are_unchanged_by_the_image_reader(tmp_path):
    """Text conversations give the same rows with or without image reading on (the text path is untouched)."""
    records = [r for r in _records(tmp_path) if isinstance(r["messages"][0]["content"], str)] * 8
    source = write_jsonl(tmp_path / "text.jsonl", records)
    plain = run_build(tmp_path / "plain", input=source, tokenizer=bundled.VL_TOKENIZER, row_tokens=32)
    read = run_build(tmp_path / "read", input=source, tokenizer=bundled.VL_TOKENIZER, row_tokens=32,
                     image_processor=bundled.IMAGE_PROCESSOR)
    assert plain["rows_sha256"] == read["rows_sha256"] and read["images"]["placements"] == 0


@pytest.mark.parametrize("case, message", [
    ("missing", r"chat.jsonl line 1: image .*nothere.png: No such file"),
    ("broken", r"chat.jsonl line 1: image .*broken.png cannot be read"),
    ("url", r"chat.jsonl line 1: message 1: content part 1: image 'https://example.com/x.png' is a URL"),
    ("no processor", r"content part 1 is 'image'; only text parts are read \(image parts with an image processor"),
    ("forged marker", r"chat.jsonl line 1: holds the noncharacters U\+FDD2/U\+FDD3"),
])
def test_bad_images_are_named_with_their_line(tmp_path, case, message):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    name = {"missing": "nothere.png", "broken": "broken.png", "url": "https://example.com/x.png"}.get(case, "x.png")
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": name}]},
                           {"role": "assistant", "content": "ok"}]}
    if case == "forged marker":  # an assistant's plain text quoting an image marker
        _image(tmp_path / "x.png", (32, 32), (0, 0, 0))
        record["messages"][1]["content"] = "see \ufdd27\ufdd3"
    options = {"image_processor": None} if case == "no processor" else {}
    with pytest.raises(ValueError, match=message):
        _build(tmp_path, [record], row_tokens=16, **options)
