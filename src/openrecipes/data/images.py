"""Image preprocessing for native-resolution vision towers (Qwen2-VL / Qwen3-VL style): each image is resized to a
grid of whole merged patches, rescaled and normalised, and cut into flattened patches in merge-block order, the
layout the vision tower reads (``models/qwen3_vl_moe/vision.py``). The parameters come from a checkpoint's
``preprocessor_config.json``; the result equals transformers' image processor for these models.

Resampling is Pillow's (the filter the published processors name): resampled pixels are an integer image, so only
the library that defines the filter reproduces them exactly. Pillow is needed only here (``pip install
openrecipes[images]``).

Legend: H, W image height and width; C channels; p patch size; t temporal patch size; m merge size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from openrecipes.utils import read_json

# Pillow's filter codes, as preprocessor_config.json stores them
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
_BOOKKEEPING = {"image_processor_type", "processor_class", "_processor_class", "auto_map", "model_type"}
# keys accepted only at the value the computation here assumes
_FIXED = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}
MAX_ASPECT_RATIO = 200  # transformers refuses longer strips than this


@dataclass(frozen=True, kw_only=True)
class ImageProcessorConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: str = "bicubic"

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"image processor {name} must be positive, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"image processor min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or not all(s > 0 for s in self.image_std):
            raise ValueError("image processor image_mean and image_std need three values (RGB), std positive")
        if self.resample not in RESAMPLE.values():
            raise ValueError(f"image processor resample {self.resample!r} is not one of {sorted(RESAMPLE.values())}")

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this: one merged token covers factor × factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "preprocessor_config.json") -> "ImageProcessorConfig":
        raw = dict(raw)
        kwargs: dict[str, Any] = {}
        size = raw.pop("size", None) or {}
        if set(size) - {"shortest_edge", "longest_edge"}:
            raise ValueError(f"{source}: size {size!r} must hold shortest_edge and longest_edge (pixel counts)")
        if "shortest_edge" in size:
            kwargs["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            kwargs["max_pixels"] = size["longest_edge"]
        for key in ("min_pixels", "max_pixels"):  # the older spelling; size wins where both are given
            value = raw.pop(key, None)
            if value is not None:
                kwargs.setdefault(key, value)
        if "resample" in raw:
            code = raw.pop("resample")
            if code not in RESAMPLE:
                raise ValueError(f"{source}: resample={code!r} is not a Pillow filter code {sorted(RESAMPLE)}")
            kwargs["resample"] = RESAMPLE[code]
        known = {f.name for f in fields(cls)} - {"min_pixels", "max_pixels", "resample"}
        for key, value in raw.items():
            if key in known:
                kwargs[key] = tuple(value) if isinstance(value, list) else value
            elif key in _FIXED:
                if value != _FIXED[key]:
                    raise ValueError(f"{source}: {key}={value!r} is not supported: only {_FIXED[key]!r}")
            elif key not in _BOOKKEEPING:
                raise ValueError(f"{source}: unknown image processor field {key!r}")
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``preprocessor_config.json`` form ``from_hf_dict`` reads back to this config."""
        codes = {name: code for code, name in RESAMPLE.items()}
        return {"patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "rescale_factor": self.rescale_factor, "resample": codes[self.resample], **_FIXED}

    @classmethod
    def from_manifest(cls, section: dict[str, Any]) -> "ImageProcessorConfig":
        """The config a rows manifest's ``images.processor`` records (its fields by name)."""
        return cls(**{f.name: tuple(section[f.name]) if isinstance(section[f.name], list) else section[f.name]
                      for f in fields(cls)})

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "ImageProcessorConfig":
        return cls.from_hf_dict(read_json(path), source=str(path))


def fit_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """The resized (height, width): each side the nearest multiple of ``factor``, then scaled down (rounding down)
    or up (rounding up) as a whole, keeping the aspect ratio, until the area lies in [min_pixels, max_pixels]."""
    if min(height, width) <= 0:
        raise ValueError(f"image size {height}x{width} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image size {height}x{width}: aspect ratio above {MAX_ASPECT_RATIO} is not supported")
    f = config.factor
    new_h, new_w = round(height / f) * f, round(width / f) * f  # Python's round: halves go to the even multiple
    if new_h * new_w > config.max_pixels:
        scale = math.sqrt(height * width / config.max_pixels)
        new_h, new_w = max(f, math.floor(height / scale / f) * f), max(f, math.floor(width / scale / f) * f)
    elif new_h * new_w < config.min_pixels:
        scale = math.sqrt(config.min_pixels / (height * width))
        new_h, new_w = math.ceil(height * scale / f) * f, math.ceil(width * scale / f) * f
    return new_h, new_w


def _resized_rgb(image: Any, size: tuple[int, int], resample: str) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError as error:
        raise ImportError("image preprocessing needs Pillow: pip install 'openrecipes[images]'") from error
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"an image array must be (height, width, 3) uint8, got {image.shape} {image.dtype}")
        image = Image.fromarray(image)
    elif not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a numpy array or a PIL image, got {type(image).__name__}")
    filters = {name: getattr(Image.Resampling, name.upper()) for name in RESAMPLE.values()}
    height, width = size
    return np.asarray(image.convert("RGB").resize((width, height), filters[resample]))


def _image_size(image: Any) -> tuple[int, int]:
    return (image.shape[0], image.shape[1]) if isinstance(image, np.ndarray) else (image.height, image.width)


def patchify(pixels_CHW: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """(C, H, W) -> (H/p · W/p, C·t·p·p): one row per patch in merge-block order (the m×m patches of one merged
    token consecutive), each patch repeated t times along time (a still image is t identical frames)."""
    c, h, w = pixels_CHW.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    blocks = pixels_CHW.reshape(c, h // (p * m), m, p, w // (p * m), m, p)
    # -> (block row, block col, row in block, col in block, C, pixel row, pixel col)
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)
    frames = blocks.unsqueeze(5).expand(*blocks.shape[:5], t, p, p)
    return frames.reshape(-1, c * t * p * p)


def preprocess_images(images: Sequence[Any], config: ImageProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values`` (all patches, C·t·p·p) float32 and ``image_grid_thw`` (N, 3) int64 (1, H/p, W/p) for
    ``images`` (numpy (H, W, 3) uint8 arrays or PIL images), as the vision tower takes them."""
    mean = torch.tensor(config.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(config.image_std, dtype=torch.float32)[:, None, None]
    patches, grids = [], []
    for image in images:
        size = fit_size(*_image_size(image), config)
        pixels = torch.from_numpy(_resized_rgb(image, size, config.resample).astype(np.float32)).permute(2, 0, 1)
        pixels = (pixels * config.rescale_factor - mean) / std
        patches.append(patchify(pixels, config))
        grids.append([1, size[0] // config.patch_size, size[1] // config.patch_size])
    if not patches:
        raise ValueError("no images to preprocess")
    return torch.cat(patches), torch.tensor(grids, dtype=torch.long)
