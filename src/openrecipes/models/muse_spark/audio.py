"""Muse Spark's waveform audio encoder and its projector into the decoder, in pure PyTorch (forward only: the
published recipes keep it frozen and do not train audio).

    x      = (w - mean(w)) / sqrt(var(w) + 1e-7)            each clip over its own samples
    frames = [Conv1d -> LayerNorm over channels -> GELU] × n   wav2vec 2.0's extractor: one frame per 20 ms at 16 kHz
    h      = Linear(LayerNorm(frames))                         feature projection to the encoder width
    h      = Block(h) × depth                                  pre-norm blocks, 1-D rotary attention within one clip
    out    = Linear(GELU(Linear(LayerNorm(h))))                final norm, then the projector to the decoder width

Clips of different lengths are padded into one batch for the convolutions (a valid frame reads valid samples only,
so padding never reaches it) and packed, without padding, for the blocks: the Qwen3-VL tower's block
(``qwen3_vl_moe.vision.VisionBlock``) attends within each clip as it attends within each image.

Legend: B clips, S samples, C conv channels, T frames, P frames of all clips, D encoder width, H decoder width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.activations import activation
from openrecipes.models.common.rope import rope_angles
from openrecipes.models.muse_spark.tower_config import MuseSparkAudioConfig
from openrecipes.models.qwen3_vl_moe.vision import VisionBlock

NORMALIZE_EPS = 1e-7  # the waveform normalisation's variance floor (wav2vec 2.0's feature extractor)
LAYER_NORM_EPS = 1e-5


class ConvLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, bias=True)
        self.layer_norm = nn.LayerNorm(c_out, eps=LAYER_NORM_EPS)

    def forward(self, x_BCS: torch.Tensor) -> torch.Tensor:
        x = self.conv(x_BCS)
        return F.gelu(self.layer_norm(x.transpose(1, 2)).transpose(1, 2))


class FeatureProjection(nn.Module):
    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(channels, eps=LAYER_NORM_EPS)
        self.projection = nn.Linear(channels, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.layer_norm(x))


class MuseSparkAudioEncoder(nn.Module):
    """``forward(waveforms (B, S), lengths (B,)) -> (features (P, D), frames per clip)``; clip b's frames are
    ``num_frames(lengths[b])`` consecutive rows, clips in order."""

    def __init__(self, config: MuseSparkAudioConfig) -> None:
        super().__init__()
        self.config = config
        channels = (1, *config.conv_dim)
        self.conv_layers = nn.ModuleList([ConvLayer(c_in, c_out, k, s) for c_in, c_out, k, s in zip(
            channels, config.conv_dim, config.conv_kernel, config.conv_stride)])
        self.feature_projection = FeatureProjection(config.conv_dim[-1], config.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)

    def forward(self, waveforms_BS: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        if waveforms_BS.dim() != 2 or lengths.shape != (waveforms_BS.shape[0],):
            raise ValueError(f"audio: expected waveforms (clips, samples) and one length per clip, got "
                             f"{tuple(waveforms_BS.shape)} and {tuple(lengths.shape)}")
        samples = [int(n) for n in lengths.tolist()]
        frames = [self.config.num_frames(n) for n in samples]
        for index, (n, count) in enumerate(zip(samples, frames)):
            if n > waveforms_BS.shape[1] or count <= 0:
                raise ValueError(f"audio clip {index}: {n} samples give {count} frames (the batch holds "
                                 f"{waveforms_BS.shape[1]} samples a clip; a frame needs at least "
                                 f"{self.receptive_field()})")
        weight = self.feature_projection.projection.weight
        valid_BS = torch.arange(waveforms_BS.shape[1], device=waveforms_BS.device) < lengths[:, None]
        x = waveforms_BS.to(weight.dtype).masked_fill(~valid_BS, 0.0)
        valid = lengths.to(x.dtype)[:, None]
        mean = x.sum(1, keepdim=True) / valid
        var = ((x - mean).masked_fill(~valid_BS, 0.0) ** 2).sum(1, keepdim=True) / valid
        x = ((x - mean) / torch.sqrt(var + NORMALIZE_EPS)).masked_fill(~valid_BS, 0.0)[:, None]
        for layer in self.conv_layers:
            x = layer(x)
        h = self.feature_projection(x.transpose(1, 2))
        packed = torch.cat([h[b, :count] for b, count in enumerate(frames)])
        positions = torch.cat([torch.arange(count, device=h.device) for count in frames])
        angles = rope_angles(positions, self.config.head_dim, self.config.rope_theta)
        for block in self.blocks:
            packed = block(packed, angles, frames)
        return self.layer_norm(packed), frames

    def receptive_field(self) -> int:
        """Samples one frame reads."""
        field = 1
        for kernel, stride in reversed(list(zip(self.config.conv_kernel, self.config.conv_stride))):
            field = (field - 1) * stride + kernel
        return field


class MuseSparkAudioProjector(nn.Module):
    """Encoder width -> decoder width: Linear, GELU, Linear (both with bias)."""

    def __init__(self, config: MuseSparkAudioConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(config.hidden_size, text_hidden)
        self.linear_2 = nn.Linear(text_hidden, text_hidden)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))
