"""Video preprocessing for native-resolution vision towers that read images as ``data/images.py`` writes them: a
video is its frames stacked along the temporal patch axis. Every frame is resized to the size the image path picks
for the first frame (``fit_size``), rescaled and normalised as an image is; the frame count is padded to a multiple of
``temporal_patch_size`` by repeating the last frame; each run of ``temporal_patch_size`` consecutive frames forms one
temporal slice of patches. A still image is the special case of ``temporal_patch_size`` identical frames, so a video
of that many copies of one image gives exactly that image's patches.

Legend: T frames, C channels, H, W frame height and width, p patch size, t temporal patch size, m merge size.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from openrecipes.data.images import ImageProcessorConfig, _image_size, _resized_rgb, fit_size


def patchify_video(pixels_TCHW: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """(T, C, H, W) with T a multiple of t -> (T/t · H/p · W/p, C·t·p·p): temporal slices in order, the patches of
    each slice in merge-block order, each row one patch's (channel, frame, pixel row, pixel column) values."""
    frames, c, h, w = pixels_TCHW.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    blocks = pixels_TCHW.reshape(frames // t, t, c, h // (p * m), m, p, w // (p * m), m, p)
    # -> (slice, block row, block col, row in block, col in block, C, frame, pixel row, pixel col)
    return blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(-1, c * t * p * p)


def preprocess_videos(videos: Sequence[Sequence[Any]],
                      config: ImageProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values_videos`` (all patches, C·t·p·p) float32 and ``video_grid_thw`` (N, 3) int64 (T/t, H/p, W/p)
    for ``videos``, each a sequence of frames (numpy (H, W, 3) uint8 arrays or PIL images) of one size."""
    mean = torch.tensor(config.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(config.image_std, dtype=torch.float32)[:, None, None]
    patches, grids = [], []
    for index, frames in enumerate(videos):
        if not frames:
            raise ValueError(f"video {index} has no frames")
        first = _image_size(frames[0])
        odd = next((i for i, frame in enumerate(frames) if _image_size(frame) != first), None)
        if odd is not None:
            raise ValueError(f"video {index}: frame {odd} is {_image_size(frames[odd])}, frame 0 is {first}; "
                             "every frame of a video must have one size")
        size = fit_size(*first, config)
        pixels = torch.stack([torch.from_numpy(_resized_rgb(frame, size, config.resample).astype(np.float32))
                              .permute(2, 0, 1) for frame in frames])
        pixels = (pixels * config.rescale_factor - mean) / std
        short = -len(frames) % config.temporal_patch_size
        if short:
            pixels = torch.cat([pixels, pixels[-1:].expand(short, -1, -1, -1)])
        patches.append(patchify_video(pixels, config))
        grids.append([pixels.shape[0] // config.temporal_patch_size, size[0] // config.patch_size,
                      size[1] // config.patch_size])
    if not patches:
        raise ValueError("no videos to preprocess")
    return torch.cat(patches), torch.tensor(grids, dtype=torch.long)
