"""Muse Spark Open's perception towers: the NaViT vision tower with its adapter, and the waveform audio encoder,
read from the ``vision_config`` and ``audio_config`` of the checkpoint's ``config.json``.

Published (seed 003): a 50-layer NaViT vision tower, image and video preprocessing, a waveform audio encoder; the
complete checkpoint holds the vision tower, a vision adapter and projection, the audio tower and the text decoder
(seed 001). Every other size and choice here is ours, listed with its reason in docs/muse_spark.md. Field names are
those the reused Qwen3-VL blocks read (``hidden_size``, ``num_heads``, ``intermediate_size``, ``hidden_act``,
``patch_size``, ...), so ``qwen3_vl_moe.vision``'s blocks, patch embedding and merger run on these configs as they are.
Every key of a tower config is a field here or refused by name.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from openrecipes.models.common.activations import check_activation
from openrecipes.models.common.hf_config import check_field_types, check_other_keys
from openrecipes.models.common.vision_geometry import PatchGeometry


def _from_dict(cls: type, raw: Any, *, source: str, section: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: {section} must be a JSON object, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    # the rule of every config.json key (docs/models.md): honoured, known not to change the computation, or refused
    check_other_keys(raw, handled=known, family=f"Muse Spark {section}", source=source)
    missing = [f.name for f in fields(cls) if f.name not in raw and f.default is MISSING]
    if missing:
        raise ValueError(f"{source}: {section} is missing required field(s) {missing}")
    check_field_types(cls, {key: value for key, value in raw.items() if key in known}, source=f"{source} {section}")
    kwargs = {key: tuple(value) if isinstance(value, list) else value for key, value in raw.items() if key in known}
    try:
        return cls(**kwargs)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def _positive(config: Any, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{section}.{name} must be a positive integer, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class MuseSparkVisionConfig(PatchGeometry):
    """The NaViT tower (patches at each image's native resolution), its adapter (m×m neighbouring patches joined
    and passed through an MLP to ``out_hidden_size``) and the projection into the decoder's width."""

    # widths and heads: not published, so config.json must give them (no default to be silently wrong)
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int                 # the adapter's output width, which the projection maps to the decoder's
    depth: int = 50                      # published: 50 layers
    patch_size: int = 14
    temporal_patch_size: int = 2         # a still image is this many identical frames; a video stacks its frames
    spatial_merge_size: int = 2          # the adapter joins m×m patches into one decoder token
    in_channels: int = 3
    max_patches_per_side: int = 256      # NaViT's factorized position tables: one row and one column table
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0         # 2-D rotary attention within each image (frame)
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        _positive(self, "vision_config", ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                                          "temporal_patch_size", "spatial_merge_size", "in_channels",
                                          "max_patches_per_side", "out_hidden_size"))
        self.check_axial_heads()
        if self.max_patches_per_side % self.spatial_merge_size:
            raise ValueError(f"vision_config.max_patches_per_side ({self.max_patches_per_side}) must be a multiple "
                             f"of spatial_merge_size ({self.spatial_merge_size})")
        check_activation(self.hidden_act, field="vision_config.hidden_act")

    def params(self, text_hidden: int) -> int:
        """Tower, adapter and the projection into a decoder of width ``text_hidden`` (``vision_tower.*`` and
        ``multi_modal_projector.*``)."""
        d, f, m, o = self.hidden_size, self.intermediate_size, self.merged_size, self.out_hidden_size
        patch = self.in_channels * self.temporal_patch_size * self.patch_size ** 2 * d + d
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        adapter = 2 * d + m * m + m + m * o + o
        return patch + 2 * self.max_patches_per_side * d + self.depth * block + 2 * d + adapter + o * text_hidden

    def projection_params(self, text_hidden: int) -> int:
        """The adapter and the projection into a decoder of width ``text_hidden``: the part of ``params`` that maps
        the tower's features into the decoder (trained unless the recipe freezes it)."""
        d, m, o = self.hidden_size, self.merged_size, self.out_hidden_size
        return 2 * d + m * m + m + m * o + o + o * text_hidden

    @classmethod
    def from_hf_dict(cls, raw: Any, *, source: str) -> "MuseSparkVisionConfig":
        return _from_dict(cls, raw, source=source, section="vision_config")

    def to_hf_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model_type": "muse_spark_vision"}


@dataclass(kw_only=True, frozen=True)
class MuseSparkAudioConfig:
    """The waveform encoder: a convolutional feature extractor over the raw (normalised) waveform, transformer blocks
    with 1-D rotary attention within each clip, a final norm, and a projector into the decoder's width."""

    # wav2vec 2.0's extractor: 7 convolutions, 320x downsampling (one frame per 20 ms at 16 kHz, 25 ms receptive field)
    conv_dim: tuple[int, ...] = (512,) * 7
    conv_kernel: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)
    conv_stride: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
    # depth, widths and heads: not published, so config.json must give them
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    hidden_act: str = "gelu"
    rope_theta: float = 10_000.0
    sampling_rate: int = 16_000          # what the waveform must be sampled at (the extractor's frame rate follows)
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        _positive(self, "audio_config", ("depth", "hidden_size", "intermediate_size", "num_heads", "sampling_rate"))
        for name in ("conv_dim", "conv_kernel", "conv_stride"):
            values = getattr(self, name)
            if not isinstance(values, tuple):
                object.__setattr__(self, name, tuple(values))
            if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
                raise ValueError(f"audio_config.{name} must be a non-empty list of positive integers, got {values!r}")
        if not len(self.conv_dim) == len(self.conv_kernel) == len(self.conv_stride):
            raise ValueError(f"audio_config: conv_dim, conv_kernel and conv_stride must have one entry per "
                             f"convolution, got {len(self.conv_dim)}, {len(self.conv_kernel)}, {len(self.conv_stride)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"audio_config: hidden_size/num_heads ({self.hidden_size}/{self.num_heads}) must be a "
                             "whole even number (rotary embedding)")
        check_activation(self.hidden_act, field="audio_config.hidden_act")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_frames(self, samples: int) -> int:
        """Frames the extractor gives for a clip of ``samples`` samples (0 when it is shorter than one frame)."""
        for kernel, stride in zip(self.conv_kernel, self.conv_stride):
            samples = (samples - kernel) // stride + 1 if samples >= kernel else 0
        return samples

    def params(self, text_hidden: int) -> int:
        """Encoder and the projector into a decoder of width ``text_hidden`` (``audio_tower.*``,
        ``audio_projector.*``)."""
        d, f = self.hidden_size, self.intermediate_size
        channels = (1, *self.conv_dim)
        convs = sum(c_in * c_out * k + 3 * c_out
                    for c_in, c_out, k in zip(channels, self.conv_dim, self.conv_kernel))
        projection = 2 * self.conv_dim[-1] + self.conv_dim[-1] * d + d
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        projector = d * text_hidden + text_hidden + text_hidden * text_hidden + text_hidden
        return convs + projection + self.depth * block + 2 * d + projector

    @classmethod
    def from_hf_dict(cls, raw: Any, *, source: str) -> "MuseSparkAudioConfig":
        return _from_dict(cls, raw, source=source, section="audio_config")

    def to_hf_dict(self) -> dict[str, Any]:
        return {**{key: list(v) if isinstance(v, tuple) else v for key, v in asdict(self).items()},
                "model_type": "muse_spark_audio"}
