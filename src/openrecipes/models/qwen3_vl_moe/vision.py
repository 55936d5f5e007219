"""Qwen3-VL's vision tower in pure PyTorch: native-resolution patches (NaViT-style, each image keeps its own grid),
a learned position grid resampled to every image, 2-D rotary attention within each image, a merger that joins
spatial_merge_size² neighbouring patches into one token of the text decoder's width, and DeepStack mergers that
hand features of chosen blocks to the first decoder layers. Parameter names follow transformers' ``model.visual``.

Patches arrive flattened, one row per patch of (channels, temporal_patch, patch, patch) values, in merge-block
order: for each image and frame, the m×m patches of one merged token are consecutive (image_processor.py).

Legend: P patches of all images, D vision width, Dh head dim, m spatial_merge_size, M = m²·D merged width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.activations import activation
from openrecipes.models.common.rope import apply_rope
from openrecipes.models.qwen3_vl_moe.config import Qwen3VLMoeVisionConfig

_EPS = 1e-6  # every LayerNorm of the tower


def block_order(h: int, w: int, m: int) -> torch.Tensor:
    """Raster indices (row·w + col) of an h×w grid listed in merge-block order."""
    raster = torch.arange(h * w).view(h // m, m, w // m, m)
    return raster.transpose(1, 2).flatten()


def axial_angles(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """2-D rotary angles (P, head_dim/2) in fp32 for patches at (rows, cols): the first half of the frequencies
    turns with the row, the second half with the column (each half the head_dim/4 frequencies of a 1-D RoPE over
    head_dim/2)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(quarter, device=rows.device, dtype=torch.float32) * 2 / (2 * quarter)))
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, config: Qwen3VLMoeVisionConfig) -> None:
        super().__init__()
        self.patch_shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=self.patch_shape[1:],
                              stride=self.patch_shape[1:], bias=True)

    def forward(self, pixels_PC: torch.Tensor) -> torch.Tensor:
        # a convolution whose kernel covers the whole patch: one matmul of the flattened patch with the kernel
        weight = self.proj.weight.flatten(1)
        return F.linear(pixels_PC.to(weight.dtype).view(-1, weight.shape[1]), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: Qwen3VLMoeVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x_PD: torch.Tensor, angles_PF: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        patches = x_PD.shape[0]
        q, k, v = self.qkv(x_PD).view(patches, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3).unbind(0)
        q, k = apply_rope(q[None], angles_PF[None])[0], apply_rope(k[None], angles_PF[None])[0]
        # bidirectional attention within each image (frame), never across images
        outs = [F.scaled_dot_product_attention(qi, ki, vi, scale=self.head_dim ** -0.5)
                for qi, ki, vi in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Qwen3VLMoeVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Qwen3VLMoeVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x_PD: torch.Tensor, angles_PF: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x_PD = x_PD + self.attn(self.norm1(x_PD), angles_PF, lengths)
        return x_PD + self.mlp(self.norm2(x_PD))


class PatchMerger(nn.Module):
    """m² neighbouring patches -> one token of the text width. The final merger normalises each patch before
    joining them; the DeepStack mergers normalise the joined vector (``norm_after_join``)."""

    def __init__(self, config: Qwen3VLMoeVisionConfig, *, norm_after_join: bool) -> None:
        super().__init__()
        self.merged = config.merged_size
        self.norm_after_join = norm_after_join
        self.norm = nn.LayerNorm(self.merged if norm_after_join else config.hidden_size, eps=_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size)

    def forward(self, x_PD: torch.Tensor) -> torch.Tensor:
        if self.norm_after_join:
            x = self.norm(x_PD.reshape(-1, self.merged))
        else:
            x = self.norm(x_PD).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # exact (erf) GELU here, unlike the blocks


class VisionModel(nn.Module):
    """``forward(pixel_values (P, C·t·p·p), grid_thw (N, 3)) -> (tokens (P/m², D_text), [deepstack tokens])``."""

    def __init__(self, config: Qwen3VLMoeVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, norm_after_join=False)
        self.deepstack_merger_list = nn.ModuleList([PatchMerger(config, norm_after_join=True)
                                                    for _ in config.deepstack_visual_indexes])

    def _positions(self, grid_thw: list[list[int]], dtype: torch.dtype, device: torch.device):
        """Per patch: the learned position embedding resampled to its image's grid (bilinear, corners aligned)
        and the rotary angles of its (row, col), both in merge-block order."""
        m, side = self.config.spatial_merge_size, int(self.config.num_position_embeddings ** 0.5)
        grid_DSS = self.pos_embed.weight.t().reshape(1, -1, side, side)
        embeds, angles = [], []
        for t, h, w in grid_thw:
            if h % m or w % m:
                raise ValueError(f"image grid {h}x{w} is not a multiple of spatial_merge_size {m}")
            order = block_order(h, w, m).to(device)
            resampled = F.interpolate(grid_DSS.float(), size=(h, w), mode="bilinear", align_corners=True)
            embeds.append(resampled[0].flatten(1).t()[order].to(dtype).repeat(t, 1))
            angle = axial_angles(order // w, order % w, self.config.head_dim, self.config.rope_theta)
            angles.append(angle.repeat(t, 1))
        return torch.cat(embeds), torch.cat(angles)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grids = [[int(v) for v in row] for row in grid_thw.tolist()]
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw describes "
                             f"{sum(t * h * w for t, h, w in grids)}")
        x = self.patch_embed(pixel_values)
        pos, angles = self._positions(grids, x.dtype, x.device)
        x = x + pos
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # attention stays within one frame
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, angles, lengths)
            if index in self.config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
