"""The trainer's side of image rows (image_rows.py writes them): the sidecar read and checked against the rows and the
image files, and the image inputs of a microbatch.

A microbatch of rows holding images gets, besides the text tensors (batching.py):
  pixel_values       (P, C·t·p·p) float32  the patches of one image per placement, in row-major placement order
  image_grid_thw     (K, 3) int64          (1, grid_h, grid_w) per placement
  image_tokens_held  (K, 2) int64          (first, count): which of the image's tokens the row holds, in order
The K placements follow the order of the image tokens in the flattened rows, so a model fills its image tokens
with the held features in that order (``ModelFamily.images``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from openrecipes.data.image_rows import IMAGES_DIR, SIDECAR_COLUMNS, SIDECAR_FILE
from openrecipes.data.images import ImageProcessorConfig, preprocess_images

CACHED_IMAGES = 1024  # preprocessed images kept in memory between microbatches
# a microbatch's image inputs, the keywords an image model's forward takes (models/families.py, ImageInputs)
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_tokens_held")


@dataclass(frozen=True, kw_only=True)
class RowImages:
    directory: Path            # the rows directory
    processor: ImageProcessorConfig
    image_token_id: int
    row_offsets: np.ndarray    # (N+1,) into the placements, sorted by row
    placements: np.ndarray     # (K, 6) int64: SIDECAR_COLUMNS
    sha256: list[str]          # per placement

    def microbatch(self, rows: np.ndarray) -> dict[str, Any]:
        """The image inputs of the rows ``rows`` (in that order); empty when they hold no image."""
        import torch

        chosen = [k for row in rows.tolist() for k in range(self.row_offsets[row], self.row_offsets[row + 1])]
        if not chosen:
            return {}
        pixels = [_preprocessed(self.directory / IMAGES_DIR / self.sha256[k], self.processor) for k in chosen]
        values = self.placements[chosen]
        grids = torch.cat([g for _, g in pixels])
        if not torch.equal(grids[:, 1:], torch.from_numpy(values[:, 4:6])):
            raise ValueError(f"{self.directory}: the images' patch grids differ from the sidecar's (another image "
                             "processor or Pillow version than the build's)")
        return {
            "pixel_values": torch.cat([p for p, _ in pixels]),
            "image_grid_thw": grids,
            "image_tokens_held": torch.from_numpy(np.ascontiguousarray(values[:, [3, 2]], dtype=np.int64)),
        }


@lru_cache(maxsize=CACHED_IMAGES)
def _preprocessed(path: Path, processor: ImageProcessorConfig) -> tuple[Any, Any]:
    from PIL import Image

    with Image.open(path) as image:
        return preprocess_images([image.convert("RGB")], processor)


def load_row_images(directory: Path, manifest: dict[str, Any], input_ids: np.ndarray) -> RowImages | None:
    """The images of a rows directory whose manifest has an ``images`` section (else None), checked: the sidecar's
    sha256, each image file's sha256 (its name), and that each placement covers image tokens of its row."""
    from openrecipes.data.manifest import MANIFEST_FILE
    from openrecipes.utils import path_inside, sha256_file

    section = manifest.get("images")
    if not section:
        return None
    sidecar = path_inside(directory, section.get("sidecar", SIDECAR_FILE), source=directory / MANIFEST_FILE,
                          key="images.sidecar", plain_name=True)
    if not sidecar.is_file() or sha256_file(sidecar) != section.get("sidecar_sha256"):
        raise ValueError(f"{sidecar}: missing or not the sidecar the manifest describes (sidecar_sha256)")
    import pyarrow.parquet as pq

    table = pq.read_table(str(sidecar))
    placements = np.stack([table.column(c).to_numpy().astype(np.int64) for c in SIDECAR_COLUMNS], axis=1) \
        if table.num_rows else np.zeros((0, len(SIDECAR_COLUMNS)), np.int64)
    sha = table.column("sha256").to_pylist() if table.num_rows else []
    n, T = input_ids.shape
    token_id = int(section["image_token_id"])
    if placements.size and (np.any(np.diff(placements[:, 0]) < 0) or placements[:, 0].max() >= n):
        raise ValueError(f"{sidecar}: placements are not sorted by row or name a row past the {n} rows")
    merge = int(section["processor"]["merge_size"])
    for (row, start, tokens, first, grid_h, grid_w), digest in zip(placements.tolist(), sha):
        if start < 0 or start + tokens > T or np.any(input_ids[row, start:start + tokens] != token_id):
            raise ValueError(f"{sidecar}: row {row} does not hold {tokens} image tokens at {start}")
        if first < 0 or first + tokens > grid_h * grid_w // (merge * merge):
            raise ValueError(f"{sidecar}: row {row} holds tokens {first}..{first + tokens - 1} of an image of "
                             f"{grid_h * grid_w // (merge * merge)}")
    held = np.bincount(placements[:, 0], weights=placements[:, 2], minlength=n) if placements.size else np.zeros(n)
    if np.any((input_ids == token_id).sum(axis=1) != held):
        raise ValueError(f"{sidecar}: a row holds image tokens the sidecar does not place")
    for digest in sorted(set(sha)):
        path = path_inside(directory / IMAGES_DIR, digest, source=sidecar, key="sha256", plain_name=True)
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise ValueError(f"{path}: missing or its bytes do not match its sha256 name")
    processor = ImageProcessorConfig.from_manifest(section["processor"])
    offsets = np.searchsorted(placements[:, 0], np.arange(n + 1)).astype(np.int64)
    return RowImages(directory=directory, processor=processor, image_token_id=token_id, row_offsets=offsets,
                     placements=placements, sha256=sha)
