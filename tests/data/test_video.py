"""Video preprocessing: frames stacked along the temporal patch axis, each frame treated as the image path treats an
image (the video of t copies of one image is that image, bitwise), the frame count padded with the last frame."""

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

from openrecipes.data.images import ImageProcessorConfig, preprocess_images  # noqa: E402
from openrecipes.data.video import preprocess_videos  # noqa: E402

CONFIG = ImageProcessorConfig(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16,
                              max_pixels=48 * 48, image_mean=(0.4, 0.5, 0.6), image_std=(0.2, 0.3, 0.25))


def frames(count, height, width, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def test_a_video_of_identical_frames_is_the_image():
    image = frames(1, 37, 53, 0)[0]
    pixels, grid = preprocess_videos([[image, image]], CONFIG)
    expected, expected_grid = preprocess_images([image], CONFIG)
    assert torch.equal(grid, expected_grid) and torch.equal(pixels, expected)


def test_frames_fill_the_temporal_axis_in_order_and_the_last_one_pads():
    video = frames(3, 30, 41, 1)
    other = frames(2, 20, 20, 2)
    pixels, grids = preprocess_videos([video, other], CONFIG)
    h, w = grids[0, 1].item(), grids[0, 2].item()
    assert grids.tolist() == [[2, h, w], [1, 4, 4]]
    # each frame alone through the image path: its rows hold (C, t, p, p) with the frame repeated t times
    per_frame = [preprocess_images([frame], CONFIG)[0].view(h * w, 3, 2, 4, 4)[:, :, 0] for frame in video]
    per_frame.append(per_frame[-1])  # 3 frames: the last one fills the second slice
    expected = torch.cat([torch.stack(per_frame[2 * s:2 * s + 2], dim=2).reshape(h * w, -1) for s in range(2)])
    assert torch.equal(pixels[:2 * h * w], expected)
    assert pixels.shape[0] == 2 * h * w + 16


def test_video_errors_name_the_video_and_frame():
    with pytest.raises(ValueError, match="video 1: frame 2 is"):
        preprocess_videos([frames(2, 20, 20, 0), frames(2, 20, 20, 1) + frames(1, 24, 20, 2)], CONFIG)
    with pytest.raises(ValueError, match="video 0 has no frames"):
        preprocess_videos([[]], CONFIG)
