"""What native-resolution vision towers share (Qwen3-VL-MoE's and Muse Spark's): heads split for a 2-D rotary
embedding, and merged tokens made of spatial_merge_size² neighbouring patches."""

from __future__ import annotations


class PatchGeometry:
    """A mixin for a vision config with ``hidden_size``, ``num_heads`` and ``spatial_merge_size``."""

    hidden_size: int
    num_heads: int
    spatial_merge_size: int

    def check_axial_heads(self, field: str = "vision_config") -> None:
        """The 2-D rotary embedding gives a quarter of each head to each of rows and columns (sin and cos)."""
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"{field}: hidden_size/num_heads ({self.hidden_size}/{self.num_heads}) must be a whole "
                             "multiple of 4 (2-D rotary embedding over rows and columns)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """Width of one merged token: the features of spatial_merge_size² neighbouring patches side by side."""
        return self.hidden_size * self.spatial_merge_size ** 2
