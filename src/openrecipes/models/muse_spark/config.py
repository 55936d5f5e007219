"""Muse Spark Open (language backbone) configuration.

Published facts (the model pages): 62 decoder layers, 46 sliding-window (2048-token causal window,
adjacent-pair RoPE) and 16 full-attention layers (no RoPE); Q/K normalization, output normalization and
a sigmoid output gate in attention; MoE blocks that project into a 4096-wide latent expert space with
pre- and post-expert normalization; sigmoid router with an FP32 weight and a frozen expert bias used
for selection only; expert FFN 4096, top-8; final-logit soft cap 20; untied LM head; two FP32
residual-gate tensors per layer; zero-centered final norm of width 8192.

Derived (our assumption): hidden 8192; 64 query heads, 8 KV heads of dim 128; output gate
8192->8192; latent projections 8192->4096 and 4096->8192; router 8192->256 over 256 experts;
vocabulary 202,048. With these, ``active_params()`` is exactly the published 44,432,883,712.

The placement of the full-attention layers is not published. ``layer_types`` is the list (read from
config.json when it has one); the default (``default_layer_types``, used when ``layer_types`` is None) is
every 4th layer from layer 0 (0, 4, ..., 60: exactly 16 of 62), chosen by the published pipeline layouts:
it puts exactly one full-attention layer in each of the seed recipe's 16 stages (3, 4 x 14, 3 layers), two
in each of the 8 stages of 7, 8 x 6, 7 and four in each of the 4 stages of 15, 16, 16, 15, so the
full-attention work, which grows with the context, is spread evenly over the stages. The placement we used
first (3, 7, ..., 59 and 61) gives the 16-stage layout none on its first stage and two on its last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from openrecipes.models.common.activations import check_activation
from openrecipes.models.common.hf_config import check_field_types, check_other_keys
from openrecipes.models.muse_spark.tower_config import MuseSparkAudioConfig, MuseSparkVisionConfig
from openrecipes.utils import read_json

SLIDING = "sliding_attention"
FULL = "full_attention"
MODEL_TYPE = "muse_spark"

# The towers' sections of config.json (tower_config.py reads them); the dataclass fields are ``vision``, ``audio``.
_TOWER_KEYS = {"vision_config": "vision", "audio_config": "audio"}
_TOKEN_KEYS = ("image_token_id", "video_token_id", "audio_token_id")


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Full attention at every 4th layer from layer 0 (0, 4, 8, ...); sliding elsewhere.

    For 62 layers: 0, 4, ..., 60, exactly the published 16, one in each 4-layer pipeline stage (see the module
    docstring for why this placement).
    """
    return tuple(FULL if i % 4 == 0 else SLIDING for i in range(num_layers))


@dataclass(kw_only=True, frozen=True)
class MuseSparkConfig:
    vocab_size: int = 202_048
    hidden_size: int = 8192
    num_hidden_layers: int = 62
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    # attention output gate: sigmoid(x @ W_gate), W_gate hidden -> heads*head_dim
    attention_output_gate: bool = True
    sliding_window: int = 2048
    layer_types: tuple[str, ...] | None = None  # None: default_layer_types(num_hidden_layers)
    rope_theta: float = 10_000.0  # assumption: not published; only sliding layers use RoPE
    rope_interleaved: bool = True  # adjacent-pair rotation (x[2i], x[2i+1])
    # MoE: hidden -> latent (down), experts on the latent, latent -> hidden (up)
    moe_latent_size: int = 4096
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 4096  # per-expert SwiGLU width (gate, up, down)
    router_score: str = "sigmoid"
    router_dtype: str = "float32"
    # Sigmoid scores are not a distribution; renormalising the top-k keeps the expert output's scale
    # independent of how confident the router is (not published; DeepSeek-V3-style choice).
    norm_topk_prob: bool = True
    final_logit_softcap: float = 20.0
    tie_word_embeddings: bool = False
    # two FP32 residual gates per layer (attention and MoE branch); shape assumed (hidden_size,)
    residual_gates_per_layer: int = 2
    rms_norm_eps: float = 1e-5
    final_norm_zero_centered: bool = True
    max_position_embeddings: int = 262_144
    hidden_act: str = "silu"          # the expert activation (common.activations)
    pad_token_id: int | None = None   # its embedding row gets no gradient (padding_idx)
    initializer_range: float = 0.02   # std of the random initialisation of every matrix
    # The perception towers of the complete checkpoint (None: the text model alone, text-only mode) and the token ids
    # whose embeddings their features replace (an image, a video, an audio clip: one id per token of features).
    vision: MuseSparkVisionConfig | None = None
    audio: MuseSparkAudioConfig | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    audio_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "sliding_window", "moe_latent_size", "num_experts", "num_experts_per_tok",
                    "moe_intermediate_size"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name!r} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        elif not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected num_hidden_layers="
                             f"{self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
        if bad:
            raise ValueError(f"layer_types: unknown type(s) {bad}; use {SLIDING!r} or {FULL!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.router_score != "sigmoid":
            raise ValueError(f"router_score={self.router_score!r} is not supported (only 'sigmoid')")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=true is not supported: Muse Spark uses an untied LM head")
        if self.router_dtype != "float32":
            raise ValueError(f"router_dtype={self.router_dtype!r} is not supported (only 'float32')")
        if self.residual_gates_per_layer != 2:
            raise ValueError(f"residual_gates_per_layer={self.residual_gates_per_layer} is not supported "
                             "(the model has one gate per residual branch: 2)")
        if not (math.isfinite(self.final_logit_softcap) and self.final_logit_softcap > 0):
            raise ValueError(f"final_logit_softcap must be a positive number, got {self.final_logit_softcap}")
        check_activation(self.hidden_act)
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not (math.isfinite(self.initializer_range) and self.initializer_range > 0):
            raise ValueError(f"initializer_range must be a positive number, got {self.initializer_range}")
        for key in _TOKEN_KEYS:
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{key}={value} is outside the vocabulary (0..{self.vocab_size - 1})")
        needed = ([("vision_config", "image_token_id"), ("vision_config", "video_token_id")] if self.vision else []) \
            + ([("audio_config", "audio_token_id")] if self.audio else [])
        for section, key in needed:
            if getattr(self, key) is None:
                raise ValueError(f"{section} is given but {key} is not: the decoder needs the token its features "
                                 "replace")
        ids = [getattr(self, key) for key in _TOKEN_KEYS if getattr(self, key) is not None]
        if len(set(ids)) != len(ids):
            raise ValueError(f"image_token_id, video_token_id and audio_token_id must differ, got {ids}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    # ---- parameter counts (docs/measure.md: N excludes the input embedding and all norms) ----
    def attention_params(self) -> int:
        """q, k, v, o projections and the output gate (no biases)."""
        q = self.hidden_size * self.num_attention_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_key_value_heads * self.head_dim
        o = self.num_attention_heads * self.head_dim * self.hidden_size
        gate = self.hidden_size * self.num_attention_heads * self.head_dim if self.attention_output_gate else 0
        return q + kv + o + gate

    def latent_projection_params(self) -> int:
        """MoE down (hidden -> latent) and up (latent -> hidden) projections."""
        return 2 * self.hidden_size * self.moe_latent_size

    def expert_params(self) -> int:
        """One expert: SwiGLU gate, up and down projections on the latent width."""
        return 3 * self.moe_latent_size * self.moe_intermediate_size

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    def residual_gate_params(self) -> int:
        return self.num_hidden_layers * self.residual_gates_per_layer * self.hidden_size

    def norm_params(self) -> int:
        """Input and post-attention norms (hidden), q/k norms and per-head output norm (head_dim),
        pre- and post-expert norms (latent); plus the final norm."""
        per_layer = 2 * self.hidden_size + 3 * self.head_dim + 2 * self.moe_latent_size
        return self.num_hidden_layers * per_layer + self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def dense_layer_params(self) -> int:
        """Matmul weights of one layer that every token uses (all but the experts)."""
        return self.attention_params() + self.latent_projection_params() + self.router_params()

    def total_params(self) -> int:
        """Every trainable parameter of the language model: layers, norms, residual gates, embedding and LM head.

        The frozen expert bias is not in it (``frozen_params``)."""
        per_layer = self.dense_layer_params() + self.num_experts * self.expert_params()
        return (self.num_hidden_layers * per_layer + self.norm_params() + self.residual_gate_params()
                + self.embedding_params() + self.lm_head_params())

    def frozen_params(self) -> int:
        """The frozen expert bias (one value per expert and layer, 62 x 256, never trained) and the perception towers
        with their adapters and projectors (frozen in the published recipes); not in ``total_params``."""
        return self.num_hidden_layers * self.num_experts + self.tower_params()

    def tower_params(self) -> int:
        """The vision tower, its adapter and projection, the audio encoder and its projector (0 in text-only mode)."""
        return ((self.vision.params(self.hidden_size) if self.vision else 0)
                + (self.audio.params(self.hidden_size) if self.audio else 0))

    def text_only(self) -> "MuseSparkConfig":
        """This config without its towers: the model text-only mode builds."""
        return replace(self, vision=None, audio=None)

    def non_embedding_params(self) -> int:
        """``total_params`` without the input embedding and the LM head (the "816B" of the model name)."""
        return self.total_params() - self.embedding_params() - self.lm_head_params()

    def active_params(self) -> int:
        """N: parameters touched per token, excluding the input embedding and all norms.

        Counted: attention (q, k, v, o, output gate), latent projections, router, top-k experts, LM head.
        Not counted: the residual gates. They are elementwise scales like norm weights (no matmul, no
        FLOPs per token worth counting); with them the total would no longer be the published figure.
        """
        per_layer = self.dense_layer_params() + self.num_experts_per_tok * self.expert_params()
        return self.num_hidden_layers * per_layer + self.lm_head_params()

    # ---- Hugging Face config.json (flat text-model fields; a nested ``text_config`` is read too) ----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "MuseSparkConfig":
        model_type = raw.get("model_type")
        if model_type not in (None, MODEL_TYPE):
            raise ValueError(f"{source}: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        text = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
        known = {f.name for f in fields(cls)} - set(_TOWER_KEYS.values())
        check_other_keys(text, handled=known | set(_TOWER_KEYS) | {"text_config"}, family="Muse Spark",
                         source=source)
        kwargs: dict[str, Any] = {key: value for key, value in text.items() if key in known}
        check_field_types(cls, kwargs, source=source)
        if kwargs.get("layer_types") is not None:
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        # an absent, null or empty section: no such tower
        if raw.get("vision_config"):
            kwargs["vision"] = MuseSparkVisionConfig.from_hf_dict(raw["vision_config"], source=source)
        if raw.get("audio_config"):
            kwargs["audio"] = MuseSparkAudioConfig.from_hf_dict(raw["audio_config"], source=source)
        try:
            return cls(**kwargs)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "MuseSparkConfig":
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _TOWER_KEYS.values()}
        out = {key: value for key, value in out.items() if not (key in _TOKEN_KEYS and value is None)}
        for key, name in _TOWER_KEYS.items():
            if getattr(self, name) is not None:
                out[key] = getattr(self, name).to_hf_dict()
        out["layer_types"] = list(self.layer_types)
        out.update(architectures=["MuseSparkForCausalLM"], model_type=MODEL_TYPE, use_cache=True)
        return out
