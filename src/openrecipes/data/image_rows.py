"""Image-text conversations in ``data build``: image parts become the chat format's image tokens, and the rows record
the images they need (docs/data.md, "Images").

An image part (``{"type": "image", "image": "path.png"}``, chat_input.py) stands in its message's content as a
numbered marker while the template renders. The rendered marker is then replaced by the format's image tokens
(``LossMaskFormat.image``: Qwen3-VL's ``<|vision_start|>``, ``<|image_pad|>`` once per merged patch, ``<|vision_end|>``),
where the number of placeholders is ``grid_h · grid_w / merge²`` of the image as data/images.py resizes it. Image
tokens are never supervised, wherever they stand. A conversation with images is encoded alone and whole.

Each image token carries ``image << 24 | k`` (the build's image number, its k-th token) through the packer, so a row
knows which tokens of which image it holds, also when a row boundary cuts an image: the sidecar ``images.parquet``
has one placement per (row, image) with the row, the first token's position in the row, how many tokens, the index
of the first held token in the image, the image's patch grid and its SHA-256. The image files are copied into
``images/<sha256>`` of the output, and the manifest's ``images.placements_sha256`` covers the placements and, through
each image's SHA-256, its bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from openrecipes.data.chat_input import IMAGE_MARKER, IMAGES_KEY, InvalidConversation, encode_with_text_tokens, image_marker
from openrecipes.data.images import ImageProcessorConfig, fit_size
from openrecipes.data.stream import LimitCounter, Piece, conversation_parts
from openrecipes.data.templates import token_mask
from openrecipes.utils import sha256_file

SIDECAR_FILE = "images.parquet"
# The most bytes one image file may hold: a 4096 x 4096 RGBA image stored uncompressed. Processors resize far below
# that (Qwen3-VL's max_pixels is about 16 megapixels), and a file is read whole (hashed, decoded, copied), so a path
# naming a multi-gigabyte file is refused before a byte of it is read
MAX_IMAGE_BYTES = 64 << 20
IMAGES_DIR = "images"
PROCESSOR_FILE = "preprocessor_config.json"
_TOKEN_BITS = 24  # the k of an image token sits in the low bits of its per-token value
PLACEMENTS_SHA256_DEFINITION = (
    "SHA-256 over the placements of images.parquet in file order; for each, its row, start, tokens, first, grid_h "
    "and grid_w as little-endian int32, followed by the 32 bytes of the image file's SHA-256")
SIDECAR_COLUMNS = ("row", "start", "tokens", "first", "grid_h", "grid_w")


@dataclass(frozen=True, kw_only=True)
class ImageEntry:
    path: Path
    sha256: str
    grid_h: int  # patches
    grid_w: int
    tokens: int  # merged patches: image tokens in the text


def read_processor(path: Path) -> ImageProcessorConfig:
    """``--image-processor``: a ``preprocessor_config.json`` or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / PROCESSOR_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--image-processor: {path} not found (a {PROCESSOR_FILE} or a directory with one)")
    return ImageProcessorConfig.from_hf_json(path)


class ImageRows:
    """The images of one build: read and checked when a conversation is rendered, recorded per row when packed."""

    def __init__(self, *, processor: ImageProcessorConfig, processor_source: str, markup: tuple[str, str, str],
                 token_ids: tuple[int, int, int], base: Path) -> None:
        self.processor, self.processor_source, self.markup, self.base = processor, processor_source, markup, base
        self.pad_id = token_ids[1]
        self.entries: list[ImageEntry] = []
        self._numbers: dict[Path, int] = {}
        self.placements: list[tuple[int, int, int, int, int]] = []  # row, start, tokens, first, image number
        self._copied: set[str] = set()
        self.staging: Path | None = None

    # -- rendering ---------------------------------------------------------------------------------------------
    def take(self, messages: list[dict[str, Any]], where: str) -> list[int]:
        """Move the images out of ``messages`` (their markers renumbered within the conversation); return the build's
        number of each, in conversation order. A missing or unreadable image is an error naming it and ``where``."""
        numbers: list[int] = []
        for message in messages:
            paths = message.pop(IMAGES_KEY, None)
            if not paths:
                continue
            offset = len(numbers)
            found = [int(m.group(1)) for m in IMAGE_MARKER.finditer(message["content"])]
            if sorted(found) != list(range(len(paths))):
                raise InvalidConversation(f"{where}: a message's image markers do not match its image parts",
                                          "bad image")
            message["content"] = IMAGE_MARKER.sub(lambda m: image_marker(offset + int(m.group(1))),
                                                  message["content"])
            numbers += [self._entry(path, where) for path in paths]
        return numbers

    def _entry(self, value: str, where: str) -> int:
        path = Path(value) if Path(value).is_absolute() else self.base / value
        if path in self._numbers:
            return self._numbers[path]
        data = read_image_file(path, where)
        try:
            from PIL import Image

            with Image.open(io.BytesIO(data)) as image:
                image.load()  # decodes the whole file: a truncated one fails here, not in training
                height, width = image.height, image.width
            new_h, new_w = fit_size(height, width, self.processor)
        except ImportError as error:
            raise ImportError("reading images needs Pillow: pip install 'openrecipes[images]'") from error
        except Exception as error:  # Pillow raises many kinds for a broken file
            raise InvalidConversation(f"{where}: image {path} cannot be read: {error}", "bad image") from None
        p, m = self.processor.patch_size, self.processor.merge_size
        entry = ImageEntry(path=path, sha256=hashlib.sha256(data).hexdigest(), grid_h=new_h // p, grid_w=new_w // p,
                           tokens=(new_h // p) * (new_w // p) // (m * m))
        self.entries.append(entry)
        self._numbers[path] = len(self.entries) - 1
        return len(self.entries) - 1

    def expand(self, text: str, spans: list[tuple[int, int]], forged: list[tuple[int, int]], numbers: list[int],
               where: str) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]], list[int]]:
        """The rendered ``text`` with each image marker replaced by the image's tokens, the character spans moved to
        match, and the build's image numbers in the order they now appear."""
        pieces: list[str] = []
        moved: list[tuple[int, int]] = []  # (old position, shift from there on)
        order: list[int] = []
        cursor = shift = 0
        start, pad, end = self.markup
        for match in IMAGE_MARKER.finditer(text):
            if int(match.group(1)) >= len(numbers):  # the conversation's own text forged a marker
                raise InvalidConversation(f"{where}: holds the noncharacters U+FDD2/U+FDD3, which mark images while "
                                          "rendering", "marker characters")
            number = numbers[int(match.group(1))]
            tokens = start + pad * self.entries[number].tokens + end
            pieces += [text[cursor:match.start()], tokens]
            shift += len(tokens) - (match.end() - match.start())
            moved.append((match.end(), shift))
            order.append(number)
            cursor = match.end()
        pieces.append(text[cursor:])
        if sorted(order) != sorted(numbers):  # a part rendered twice or not at all, or a forged marker
            raise InvalidConversation(f"{where}: the chat template did not render each image part once (or the text "
                                      "holds the noncharacters U+FDD2/U+FDD3 that mark them)", "template error")

        def at(position: int) -> int:
            return position + next((s for stop, s in reversed(moved) if stop <= position), 0)

        return "".join(pieces), [(at(a), at(b)) for a, b in spans], [(at(a), at(b)) for a, b in forged], order

    def pieces(self, tokenizer: Any, text: str, spans: list[tuple[int, int]], forged: list[tuple[int, int]],
               forbidden: re.Pattern[str] | None, order: list[int], eos_id: int, limit: LimitCounter,
               where: str) -> Iterator[Piece]:
        """The conversation as one piece, its image tokens unsupervised and numbered (``Piece.images``)."""
        if len(forged):
            ids, offsets = encode_with_text_tokens(tokenizer, text, forged, forbidden)
        else:
            encoding = tokenizer.encode(text, add_special_tokens=False)
            ids, offsets = encoding.ids, encoding.offsets
        ids = np.asarray(ids, dtype=np.int32)
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        aux = np.full(ids.size, -1, dtype=np.int64)
        starts, lengths = _runs(ids == self.pad_id)
        expected = [self.entries[n].tokens for n in order]
        if lengths.tolist() != expected:
            raise InvalidConversation(f"{where}: the text holds image-token runs of {lengths.tolist()} tokens where "
                                      f"its images need {expected}", "template error")
        for start, count, number in zip(starts.tolist(), lengths.tolist(), order):
            aux[start:start + count] = (number << _TOKEN_BITS) + np.arange(count)
        part = conversation_parts(ids, offsets, spans, eos_id, limit)
        if part is None:
            return
        ids, mask = part
        aux = np.concatenate([aux[:ids.size - 1], [-1]])
        mask[aux >= 0] = 0  # image tokens are inputs, never targets
        yield Piece(ids=ids, mask=mask, lengths=np.array([ids.size], dtype=np.int64), images=aux)

    # -- packing -----------------------------------------------------------------------------------------------
    def record(self, aux_RT: np.ndarray, first_row: int) -> None:
        """Note the images held by the kept rows ``aux_RT`` (rows first_row, first_row + 1, ...); copy their files."""
        for r in np.flatnonzero((aux_RT >= 0).any(axis=1)).tolist():
            row = aux_RT[r]
            index = np.flatnonzero(row >= 0)
            number, k = row[index] >> _TOKEN_BITS, row[index] & ((1 << _TOKEN_BITS) - 1)
            cuts = np.flatnonzero((np.diff(index) != 1) | (np.diff(number) != 0) | (np.diff(k) != 1)) + 1
            for run in np.split(np.arange(index.size), cuts):
                image = int(number[run[0]])
                self.placements.append((first_row + r, int(index[run[0]]), run.size, int(k[run[0]]), image))
                self._copy(self.entries[image])

    def _copy(self, entry: ImageEntry) -> None:
        if entry.sha256 in self._copied:
            return
        assert self.staging is not None, "ImageRows.staging is set before packing"
        data = read_image_file(entry.path, "copying the images into the rows")
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ValueError(f"image {entry.path} changed during the build")
        folder = self.staging / IMAGES_DIR
        folder.mkdir(exist_ok=True)
        (folder / entry.sha256).write_bytes(data)
        self._copied.add(entry.sha256)

    def finish(self, staging: Path) -> dict[str, Any]:
        """Write the sidecar; return the manifest's ``images`` section."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = np.array([p[:4] for p in self.placements], dtype=np.int32).reshape(-1, 4)
        entries = [self.entries[p[4]] for p in self.placements]
        grids = np.array([(e.grid_h, e.grid_w) for e in entries], dtype=np.int32).reshape(-1, 2)
        table = np.concatenate([rows, grids], axis=1)
        digest = hashlib.sha256()
        for values, entry in zip(table, entries):
            digest.update(values.astype("<i4").tobytes())
            digest.update(bytes.fromhex(entry.sha256))
        columns = {name: pa.array(table[:, i]) for i, name in enumerate(SIDECAR_COLUMNS)}
        columns["sha256"] = pa.array([e.sha256 for e in entries], type=pa.string())
        pq.write_table(pa.table(columns), str(staging / SIDECAR_FILE), compression="zstd")
        return {
            "processor": {**asdict(self.processor), "source": self.processor_source},
            "tokens": list(self.markup), "image_token_id": self.pad_id,
            "sidecar": SIDECAR_FILE, "sidecar_sha256": sha256_file(staging / SIDECAR_FILE),
            "directory": IMAGES_DIR, "files": len(self._copied), "placements": len(self.placements),
            "image_tokens": int(rows[:, 2].sum()),
            "placements_sha256": digest.hexdigest(), "placements_sha256_definition": PLACEMENTS_SHA256_DEFINITION,
        }


def read_image_file(path: Path, where: str) -> bytes:
    """The bytes of an image file. Refused before reading: a path that is not a regular file (a FIFO would block the
    build, /dev/zero or /dev/urandom never end) and a file over ``MAX_IMAGE_BYTES``; checked on the opened file too,
    so a path swapped after the first look is refused as well."""
    def refuse(reason: str) -> InvalidConversation:
        return InvalidConversation(f"{where}: image {path} {reason}", "bad image")

    def check(info: os.stat_result) -> None:
        if not stat.S_ISREG(info.st_mode):
            raise refuse("is not a regular file (a directory, FIFO, socket or device); only image files are read")
        if info.st_size > MAX_IMAGE_BYTES:
            raise refuse(f"is {info.st_size:,} bytes, over the {MAX_IMAGE_BYTES:,}-byte limit for one image")

    try:
        check(os.stat(path))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO put there since: no wait for a writer
        with os.fdopen(fd, "rb") as handle:
            check(os.fstat(handle.fileno()))
            data = handle.read(MAX_IMAGE_BYTES + 1)
    except OSError as error:
        raise InvalidConversation(f"{where}: image {path}: {error.strerror or error}", "bad image") from None
    if len(data) > MAX_IMAGE_BYTES:  # grew since it was looked at
        raise refuse(f"is over the {MAX_IMAGE_BYTES:,}-byte limit for one image")
    return data


def _runs(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the runs of True in ``flags``."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return starts, stops - starts


def open_images(config: Any, bundle: Any, fmt: Any) -> ImageRows | None:
    """The build's ``ImageRows`` when ``config.image_processor`` is set (else None): the chat format must have image
    tokens and the tokenizer must know them."""
    if config.image_processor is None:
        return None
    if fmt.image is None:
        raise ValueError(f"--image-processor: the {fmt.name} chat format has no image tokens")
    ids = tuple(bundle.token_id(token) for token in fmt.image)
    missing = [token for token, i in zip(fmt.image, ids) if i is None]
    if missing:
        raise ValueError(f"--tokenizer: {config.tokenizer} has no token {missing[0]!r}, which images in the "
                         f"{fmt.name} format need")
    source = Path(config.input)
    return ImageRows(processor=read_processor(config.image_processor), processor_source=str(config.image_processor),
                     markup=fmt.image, token_ids=ids, base=source if source.is_dir() else source.parent)
