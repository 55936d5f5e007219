"""Image preprocessing against transformers' Qwen2-VL image processor (the processor Qwen3-VL-MoE checkpoints
name), built offline from Qwen3-VL's processor parameters, on generated images of several sizes and shapes."""

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
pil_processor = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

from openrecipes.data.images import ImageProcessorConfig, fit_size, preprocess_images  # noqa: E402

# Qwen3-VL's preprocessor_config.json values; a second, small max_pixels makes large images shrink
QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                size={"shortest_edge": 65536, "longest_edge": 16777216})
SMALL = {**QWEN3_VL, "size": {"shortest_edge": 4096, "longest_edge": 64 * 64 * 6}}
# (height, width): upscaled to min_pixels, square, tall, wide strips, odd sizes, and halves that round to even
SIZES = [(100, 150), (333, 222), (512, 512), (40, 900), (700, 33), (272, 304), (48, 80)]


@pytest.mark.parametrize("params", [QWEN3_VL, SMALL], ids=["qwen3-vl", "small-max-pixels"])
def test_pixels_and_grids_equal_the_transformers_processor(params):
    reference = pil_processor.Qwen2VLImageProcessorPil(**params)
    config = ImageProcessorConfig.from_hf_dict(reference.to_dict())
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]
    expected = reference(images=images, return_tensors="pt")
    pixels, grids = preprocess_images(images, config)
    assert torch.equal(grids, expected["image_grid_thw"])
    assert pixels.shape == expected["pixel_values"].shape
    assert (pixels - expected["pixel_values"]).abs().max().item() <= 1e-6
    for (h, w), grid in zip(SIZES, grids.tolist()):
        assert fit_size(h, w, config) == (grid[1] * 16, grid[2] * 16)
        assert grid[1] % 2 == 0 and grid[2] % 2 == 0  # whole merged tokens
        area = grid[1] * grid[2] * 256
        assert config.min_pixels <= area <= config.max_pixels


def test_processor_config_errors_name_the_field():
    with pytest.raises(ValueError, match="'crop_size'"):
        ImageProcessorConfig.from_hf_dict({**QWEN3_VL, "crop_size": 224})
    with pytest.raises(ValueError, match="do_normalize"):
        ImageProcessorConfig.from_hf_dict({**QWEN3_VL, "do_normalize": False})
    with pytest.raises(ValueError, match="aspect ratio"):
        fit_size(10, 2100, ImageProcessorConfig())
    with pytest.raises(ValueError, match=r"\(height, width, 3\) uint8"):
        preprocess_images([np.zeros((32, 32), dtype=np.uint8)], ImageProcessorConfig())
