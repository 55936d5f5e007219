"""Scaled RoPE as transformers computes it for a checkpoint's ``rope_scaling`` / ``rope_parameters``: ``linear``
(positions divided by the factor), ``dynamic`` (NTK-aware: past ``max_position_embeddings`` the base grows with the
batch's length) and ``yarn`` (YaRN, arXiv 2309.00071: each frequency between its extrapolated and interpolated value
along a linear ramp over the dimensions, and cos/sin scaled by an attention factor).

``dynamic``, as transformers' ``_compute_dynamic_ntk_parameters``: with L the batch's largest position + 1 (at least
``max_position_embeddings`` M), the base becomes ``theta * (factor * L / M - (factor - 1)) ** (d / (d - 2))``, so
up to M it is plain RoPE. transformers' module keeps the longest L since its last batch shorter than M (a state that
depends on the batches before); here each batch uses its own L, which is the same for every first forward and for
training on rows of one length.

YaRN's pieces, as transformers 5.x defines them (``modeling_rope_utils``): the ramp runs between the dimensions whose
wavelength makes ``beta_fast`` and ``beta_slow`` rotations over ``original_max_position_embeddings`` (rounded out
unless ``truncate`` is false); the attention factor is given, or ``mscale(factor, mscale) / mscale(factor,
mscale_all_dim)`` when both are set, else ``mscale(factor)``, with ``mscale(s, m) = 0.1 m ln s + 1`` (1 for s <= 1).
A family may apply more (DeepSeek-V3 also scales its softmax by ``mscale(factor, mscale_all_dim)²``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# the keys each scaled type reads, besides rope_type/type/rope_theta; anything else in the dict is refused by name
ROPE_SCALING_KEYS = {"linear": frozenset({"factor"}), "dynamic": frozenset({"factor"}),
                     "yarn": frozenset({"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                        "mscale", "mscale_all_dim", "attention_factor", "truncate"})}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(rope: dict[str, Any], key: str, source: str, *, default: float | None = None, positive: bool = True):
    value = rope.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise ValueError(f"{source}: rope_scaling.{key} must be a {'positive ' if positive else ''}number, got "
                         f"{value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    kind: str = "default"  # default, linear, dynamic or yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, rope: dict[str, Any], *, max_position_embeddings: int, source: str) -> "RopeScaling":
        """From the RoPE dict ``hf_config.read_rope`` chose (its keys already checked against the type's)."""
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            return cls()
        factor = _number(rope, "factor", source)
        if kind in ("linear", "dynamic"):
            if factor is None:
                raise ValueError(f"{source}: rope_scaling.factor is required for {kind} RoPE scaling")
            # dynamic scales against the model's max_position_embeddings (kept here as the trained length)
            return cls(kind=kind, factor=factor, original_max_position_embeddings=(
                max_position_embeddings if kind == "dynamic" else None))
        original = rope.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError(f"{source}: rope_scaling.original_max_position_embeddings must be a positive integer for "
                             f"YaRN, got {original!r}")
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{source}: rope_scaling.truncate must be true or false, got {truncate!r}")
        return cls(kind=kind, factor=factor if factor is not None else max_position_embeddings / original,
                   original_max_position_embeddings=original,
                   beta_fast=_number(rope, "beta_fast", source, default=32.0) or 32.0,
                   beta_slow=_number(rope, "beta_slow", source, default=1.0) or 1.0,
                   mscale=_number(rope, "mscale", source, positive=False),
                   mscale_all_dim=_number(rope, "mscale_all_dim", source, positive=False),
                   attention_factor=_number(rope, "attention_factor", source), truncate=truncate)

    def to_hf(self) -> dict[str, Any] | None:
        """The ``rope_scaling`` dict transformers reads back to this (None for plain RoPE)."""
        if self.kind == "default":
            return None
        if self.kind in ("linear", "dynamic"):
            return {"rope_type": self.kind, "factor": self.factor}
        out = {"rope_type": "yarn", "factor": self.factor,
               "original_max_position_embeddings": self.original_max_position_embeddings,
               "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
        extra = {"mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim,
                 "attention_factor": self.attention_factor}
        return {**out, **{key: value for key, value in extra.items() if value is not None}}

    @property
    def cos_sin_factor(self) -> float:
        """What transformers multiplies cos and sin by: YaRN's attention factor, 1 otherwise."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, head_dim: int, theta: float, device: torch.device | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The (head_dim / 2,) inverse frequencies, fp32; ``dynamic`` reads the batch's ``position_ids``."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        if self.kind == "dynamic" and position_ids is not None:
            return 1.0 / (self._dynamic_base(head_dim, theta, position_ids) ** exponents)
        plain = 1.0 / (theta ** exponents)
        if self.kind in ("default", "dynamic"):
            return plain
        if self.kind == "linear":
            return plain / self.factor
        low, high = self._ramp_bounds(head_dim, theta)
        if low == high:
            high += 0.001  # one dimension: a step, not a division by zero
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolated = 1 - ramp  # 1: keep the trained frequency (fast dimensions), 0: interpolate (slow ones)
        return plain / self.factor * (1 - extrapolated) + plain * extrapolated

    def _dynamic_base(self, head_dim: int, theta: float, position_ids: torch.Tensor) -> torch.Tensor:
        """The grown base as a 0-d fp32 tensor on the positions' device (no host sync)."""
        trained = self.original_max_position_embeddings
        length = torch.clamp((position_ids.max() + 1).float(), min=trained)
        return theta * (self.factor * length / trained - (self.factor - 1)) ** (head_dim / (head_dim - 2))

    def _ramp_bounds(self, head_dim: int, theta: float) -> tuple[float, float]:
        def dimension(rotations: float) -> float:  # the dimension making this many turns over the trained length
            return head_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)
