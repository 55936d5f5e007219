"""Muse Spark's NaViT vision tower, its adapter and the projection into the decoder, in pure PyTorch.

Built on the Qwen3-VL tower's parts (``qwen3_vl_moe.vision``: patch embedding, pre-norm blocks with 2-D rotary
attention within each image, the merger of m×m neighbouring patches); what is Muse Spark's own is the position
scheme: NaViT's factorized learned embeddings, one table for the patch's row and one for its column, added to the
patch embedding, so any image up to ``max_patches_per_side`` patches a side is embedded without resampling a grid.
Images and videos share the tower: a video's frames are stacked along the temporal patch axis (``grid_thw`` t > 1),
every temporal slice gets the same row and column positions, and attention stays within one slice.

Patches arrive as ``data/images.py`` and ``data/video.py`` write them: one row per patch of (channels, temporal
patch, patch, patch) values, in merge-block order (the m×m patches of one merged token consecutive).

Legend: P patches of all images, D vision width, m spatial_merge_size, O adapter width, H decoder width.
"""

from __future__ import annotations

import torch
from torch import nn

from openrecipes.models.muse_spark.tower_config import MuseSparkVisionConfig
from openrecipes.models.qwen3_vl_moe.vision import PatchEmbed, PatchMerger, VisionBlock, axial_angles, block_order


class FactorizedPositions(nn.Module):
    """NaViT's position embedding: ``rows[r] + cols[c]`` for the patch in row r and column c of its image."""

    def __init__(self, config: MuseSparkVisionConfig) -> None:
        super().__init__()
        self.rows = nn.Embedding(config.max_patches_per_side, config.hidden_size)
        self.cols = nn.Embedding(config.max_patches_per_side, config.hidden_size)

    def forward(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self.rows(rows) + self.cols(cols)


class MuseSparkVisionTower(nn.Module):
    """``forward(pixel_values (P, C·t·p·p), grid_thw (N, 3)) -> (P / m², O)``: the adapter's merged tokens."""

    def __init__(self, config: MuseSparkVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.position_embedding = FactorizedPositions(config)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        # m×m patches -> one token: LayerNorm per patch, join, Linear + GELU + Linear to the adapter width O
        self.adapter = PatchMerger(config, norm_after_join=False)

    def positions(self, grids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(rows, cols) of every patch in merge-block order, and the patches per temporal slice."""
        m, side = self.config.spatial_merge_size, self.config.max_patches_per_side
        rows, cols, lengths = [], [], []
        for index, (t, h, w) in enumerate(grids):
            if t <= 0 or h <= 0 or w <= 0 or h % m or w % m:
                raise ValueError(f"grid_thw[{index}] = {[t, h, w]}: sizes must be positive and h, w multiples of "
                                 f"spatial_merge_size {m}")
            if max(h, w) > side:
                raise ValueError(f"grid_thw[{index}] = {[t, h, w]}: more than max_patches_per_side = {side} patches "
                                 "on a side")
            order = block_order(h, w, m).to(device)
            rows.append((order // w).repeat(t))
            cols.append((order % w).repeat(t))
            lengths += [h * w] * t
        return torch.cat(rows), torch.cat(cols), lengths

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [[int(v) for v in row] for row in grid_thw.tolist()]
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw describes "
                             f"{sum(t * h * w for t, h, w in grids)}")
        rows, cols, lengths = self.positions(grids, pixel_values.device)
        x = self.patch_embed(pixel_values)
        x = x + self.position_embedding(rows, cols).to(x.dtype)
        angles = axial_angles(rows, cols, self.config.head_dim, self.config.rope_theta)
        for block in self.blocks:
            x = block(x, angles, lengths)
        return self.adapter(self.post_layernorm(x))


class MuseSparkVisionProjector(nn.Module):
    """The projection of the adapter's tokens into the decoder's width (no bias)."""

    def __init__(self, config: MuseSparkVisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(config.out_hidden_size, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
