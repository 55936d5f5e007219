"""Muse Spark Open in pure PyTorch: the decoder and its LM head, with the perception towers when the config has them
(``vision.py``: NaViT tower, adapter and projection; ``audio.py``: waveform encoder and projector).

Parameter names follow the Hugging Face layout of a multimodal checkpoint: the decoder lives under
``model.language_model.*``, the LM head is ``lm_head.weight``; grouped experts are the one exception
(``...mlp.experts.{gate,up,down}_proj`` of shape (E, out, in); ``hf.py`` writes them fused or per expert).

One layer (pre-norm, gated residuals, both gates fp32 and initialised to ones):
    h   = x + g_attn ⊙ Attn(RMSNorm(x))
    out = h + g_mlp  ⊙ LatentMoE(RMSNorm(h))
Attn: q/k RMSNorm per head; sliding layers rotate q, k with adjacent-pair RoPE and see ``sliding_window`` tokens,
full layers use no RoPE and see the whole (causal, same-document) past; per-head RMSNorm of the attention output,
then the sigmoid output gate sigmoid(x @ W_gateᵀ) (x = the layer's normed input), then o_proj.
LatentMoE: the router scores the hidden state; the token is projected hidden -> latent, RMS-normed, sent to its
top-k experts (SwiGLU on the latent width), the gated sum is RMS-normed, then projected latent -> hidden.
Final: zero-centered RMSNorm (1 + w), untied LM head, logits = cap · tanh(logits / cap) with cap 20.

Where the published material is silent, our choices (docs/muse_spark.md has the reasons): output norm before the
output gate; the gate reads the normed layer input; router on the hidden state, sigmoid top-k weights renormalised;
post-expert norm after the weighted sum; residual gates are per-channel vectors initialised to ones and applied in
fp32; no embedding scaling; RMSNorm eps 1e-5; RoPE theta 10,000; init N(0, initializer_range = 0.02) for every matrix, expert bias 0.

Legend: B rows, T tokens per row, D hidden, L latent width, H query heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openrecipes.models.common.attention import Documents, attention
from openrecipes.models.common.init import SeededFill, build_on_meta, fill_seeded_normal_
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.moe import GroupedExperts, LocalTokenDispatcher
from openrecipes.models.common.norms import RMSNorm
from openrecipes.models.common.rope import apply_rope, rope_angles
from openrecipes.models.common.router import KeepFP32, SigmoidTopKRouter
from openrecipes.models.muse_spark.audio import MuseSparkAudioEncoder, MuseSparkAudioProjector
from openrecipes.models.muse_spark.config import SLIDING, MuseSparkConfig
from openrecipes.models.muse_spark.vision import MuseSparkVisionProjector, MuseSparkVisionTower
from openrecipes.models.qwen3_vl_moe.model import held_feature_index


class ResidualGate(KeepFP32):
    """x + g ⊙ branch with an fp32 per-channel g; the sum is formed in fp32 and rounded once."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))

    def forward(self, x_BTD: torch.Tensor, branch_BTD: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(torch.promote_types(self.weight.dtype, x_BTD.dtype), torch.float32)
        return (x_BTD.to(compute) + self.weight.to(compute) * branch_BTD.to(compute)).to(x_BTD.dtype)


class MuseSparkAttention(nn.Module):
    def __init__(self, config: MuseSparkConfig, layer_type: str, kernels: KernelOptions) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.window = config.sliding_window if layer_type == SLIDING else None
        self.pairing = "adjacent" if config.rope_interleaved else "half"
        self.backend = kernels.attention  # a name, or a callable parallelism plugs in (context parallelism)
        d, heads, kv_heads, dh = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                  config.head_dim)
        self.q_proj = nn.Linear(d, heads * dh, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * dh, bias=False)
        self.o_proj = nn.Linear(heads * dh, d, bias=False)
        self.output_gate_proj = nn.Linear(d, heads * dh, bias=False) if config.attention_output_gate else None
        self.q_norm = RMSNorm(dh, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(dh, eps=config.rms_norm_eps)
        self.o_norm = RMSNorm(dh, eps=config.rms_norm_eps)

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        rows, tokens, _ = x_BTD.shape
        # Heads are inferred (-1) so tensor parallelism can shard the projections without touching this code.
        q = self.q_norm(self.q_proj(x_BTD).view(rows, tokens, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BTD).view(rows, tokens, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BTD).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        if self.window is not None:  # full-attention layers carry no position signal but causality
            q = apply_rope(q, angles_BTF, pairing=self.pairing)
            k = apply_rope(k, angles_BTF, pairing=self.pairing)
        out = attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim), documents=documents, window=self.window,
                        backend=self.backend)
        out = self.o_norm(out.transpose(1, 2)).reshape(rows, tokens, -1)
        if self.output_gate_proj is not None:
            out = out * torch.sigmoid(self.output_gate_proj(x_BTD))
        return self.o_proj(out)


class MuseSparkLatentMoe(nn.Module):
    """Router on the hidden state; experts on the latent width between a down and an up projection.

    ``token_dispatcher`` is swapped by expert parallelism (not an nn.Module attribute), as in ``SparseMoeBlock``.
    """

    def __init__(self, config: MuseSparkConfig, kernels: KernelOptions) -> None:
        super().__init__()
        d, latent = config.hidden_size, config.moe_latent_size
        self.gate = SigmoidTopKRouter(d, config.num_experts, config.num_experts_per_tok,
                                      normalize_top_k=config.norm_topk_prob,
                                      balanced_routing=kernels.balanced_routing)
        self.latent_down_proj = nn.Linear(d, latent, bias=False)
        self.pre_expert_norm = RMSNorm(latent, eps=config.rms_norm_eps)
        self.experts = GroupedExperts(config.num_experts, latent, config.moe_intermediate_size,
                                      activation=config.hidden_act, backend=kernels.experts)
        self.post_expert_norm = RMSNorm(latent, eps=config.rms_norm_eps)
        self.latent_up_proj = nn.Linear(latent, d, bias=False)
        self.token_dispatcher = LocalTokenDispatcher()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        routing = self.gate(x_TD)
        z_TL = self.pre_expert_norm(self.latent_down_proj(x_TD))
        y_TL = self.token_dispatcher(z_TL, routing, self.experts)
        return self.latent_up_proj(self.post_expert_norm(y_TL)).reshape(x_BTD.shape)


class MuseSparkDecoderLayer(nn.Module):
    def __init__(self, config: MuseSparkConfig, layer_type: str, kernels: KernelOptions) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = MuseSparkAttention(config, layer_type, kernels)
        self.attn_residual_gate = ResidualGate(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MuseSparkLatentMoe(config, kernels)
        self.mlp_residual_gate = ResidualGate(config.hidden_size)

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        h = self.attn_residual_gate(x_BTD, self.self_attn(self.input_layernorm(x_BTD), angles_BTF, documents))
        return self.mlp_residual_gate(h, self.mlp(self.post_attention_layernorm(h)))


class MuseSparkTextModel(nn.Module):
    def __init__(self, config: MuseSparkConfig, kernels: KernelOptions) -> None:
        super().__init__()
        # padding_idx: the pad token's row gets no gradient (transformers' convention)
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size,
                                                              padding_idx=config.pad_token_id)
        # A dict keyed by layer index keeps parameter names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): MuseSparkDecoderLayer(config, kind, kernels)
                                     for i, kind in enumerate(config.layer_types)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                            zero_centered=config.final_norm_zero_centered)


class MuseSparkModel(nn.Module):
    """The multimodal container: the towers and their adapters (when the config has them; text-only mode holds the
    language model alone) and the language model."""

    def __init__(self, config: MuseSparkConfig, kernels: KernelOptions) -> None:
        super().__init__()
        if config.vision is not None:
            self.vision_tower = MuseSparkVisionTower(config.vision)
            self.multi_modal_projector = MuseSparkVisionProjector(config.vision, config.hidden_size)
        if config.audio is not None:
            self.audio_tower = MuseSparkAudioEncoder(config.audio)
            self.audio_projector = MuseSparkAudioProjector(config.audio, config.hidden_size)
        self.language_model = MuseSparkTextModel(config, kernels)

    def tower_features(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                       pixel_values_videos: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
                       audio_values: torch.Tensor | None,
                       audio_lengths: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
        """(token id field, features (N, D_text)) for each modality given, in the decoder's width."""
        out = []
        for name, pixels, grid in (("image", pixel_values, image_grid_thw),
                                   ("video", pixel_values_videos, video_grid_thw)):
            if pixels is None:
                continue
            if not hasattr(self, "vision_tower"):
                raise ValueError(f"{name}s given, but this model has no vision tower (a text-only config)")
            if grid is None:
                raise ValueError(f"{name} pixel values given without {name}_grid_thw")
            out.append((f"{name}_token_id", self.multi_modal_projector(self.vision_tower(pixels, grid))))
        if audio_values is not None:
            if not hasattr(self, "audio_tower"):
                raise ValueError("audio given, but this model has no audio tower (a text-only config)")
            if audio_lengths is None:
                raise ValueError("audio_values given without audio_lengths")
            features, _ = self.audio_tower(audio_values, audio_lengths)
            out.append(("audio_token_id", self.audio_projector(features)))
        return out


class MuseSparkForCausalLM(nn.Module):
    """``forward(input_ids, position_ids=None, documents=None) -> logits (B, T, V)``, soft-capped.

    A pipeline stage may drop ``model.language_model.embed_tokens`` (then the input is hidden states) or
    ``model.language_model.norm`` and ``lm_head`` (then the output is hidden states).
    """

    def __init__(self, config: MuseSparkConfig, kernels: KernelOptions = KernelOptions()) -> None:
        super().__init__()
        self.config = config
        self.model = MuseSparkModel(config, kernels)
        self.lm_head: nn.Linear | None = SoftCappedLinear(config.hidden_size, config.vocab_size,
                                                          config.final_logit_softcap)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None, *, layers: range | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                audio_values: torch.Tensor | None = None, audio_lengths: torch.Tensor | None = None,
                image_tokens_held: torch.Tensor | None = None) -> torch.Tensor:
        """``layers``: run only these decoder layers (global indices; an interleaved pipeline chunk). The embedding
        runs before layer 0 and the final norm and head after the last layer.

        Images and videos (``pixel_values``/``image_grid_thw``, ``pixel_values_videos``/``video_grid_thw``, as
        ``data/images.py`` and ``data/video.py`` give them) and audio clips (``audio_values`` (clips, samples),
        ``audio_lengths``) run through their towers; their features replace the embeddings of the ``image_token_id``,
        ``video_token_id`` and ``audio_token_id`` tokens, in order. Those tokens take positions like text tokens
        (the decoder's RoPE is 1-D), so ``position_ids`` is (B, T), or (1, B, T) as training passes the positions of
        image rows (``ImageInputs.positions``, one axis).

        ``image_tokens_held`` (K, 2): packed training rows (data/image_batch.py) hold tokens first .. first + count - 1
        of image k, for each (first, count); only those tokens' features are placed (a row boundary or a context
        parallel cut may leave a row part of an image)."""
        text = self.model.language_model
        rows, tokens = input_ids.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(tokens, device=input_ids.device).expand(rows, tokens)
        elif position_ids.dim() == 3:
            if position_ids.shape[0] != 1:
                raise ValueError(f"position_ids of shape {tuple(position_ids.shape)}: Muse Spark's positions have one "
                                 "axis (1-D RoPE)")
            position_ids = position_ids[0]
        first = layers is None or layers.start == 0
        last = layers is None or layers.stop == self.config.num_hidden_layers
        h = text.embed_tokens(input_ids) if text.embed_tokens is not None and first else input_ids
        features = self.model.tower_features(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                             audio_values, audio_lengths)
        if features and (text.embed_tokens is None or not first):
            raise ValueError("images, videos and audio need a forward that runs the embedding")
        for key, values in features:
            if key == "image_token_id" and image_tokens_held is not None:
                index = held_feature_index(image_grid_thw, image_tokens_held, self.config.vision.spatial_merge_size)
                values = values[index]
            mask = input_ids == getattr(self.config, key)
            if int(mask.sum()) != values.shape[0]:
                raise ValueError(f"input_ids hold {int(mask.sum())} tokens of {key} {getattr(self.config, key)}, "
                                 f"the inputs give {values.shape[0]} features")
            h = h.masked_scatter(mask[..., None], values.to(h.dtype))
        angles = rope_angles(position_ids, self.config.head_dim, self.config.rope_theta)
        chosen = text.layers.values() if layers is None else [text.layers[str(i)] for i in layers]
        for layer in chosen:
            h = layer(h, angles, documents)
        if text.norm is not None and last:
            h = text.norm(h)
        if self.lm_head is None or not last:
            return h
        return self.lm_head(h)  # SoftCappedLinear: the soft cap is part of the head

    def set_attention_backend(self, backend: str) -> None:
        """``auto``, ``reference``, ``sdpa`` or ``varlen`` for every layer (see common/attention.py)."""
        for module in self.modules():
            if isinstance(module, MuseSparkAttention):
                module.backend = backend

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0, fill: SeededFill = fill_seeded_normal_) -> None:
        """Initialise every parameter (after ``to_empty`` from the meta device).

        Matrices (projections, router, experts, embedding, LM head) ~ N(0, initializer_range), each from its own
        generator seeded by (seed, name) so a pipeline stage gets exactly the values the whole model would have;
        norms 1 (the zero-centered final norm stores w - 1, so 0); residual gates 1; expert bias 0; the pad token's
        embedding row 0. Towers: LayerNorm weights 1, every bias 0, the rest ~ N(0, the tower's initializer_range).
        """
        stds = {"model.vision_tower.": self.config.vision, "model.multi_modal_projector.": self.config.vision,
                "model.audio_tower.": self.config.audio, "model.audio_projector.": self.config.audio}
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                tower = next((config for prefix, config in stds.items() if name.startswith(prefix)), None)
                if tower is not None:
                    if isinstance(module, nn.LayerNorm) and param_name == "weight":
                        param.fill_(1.0)
                    elif param_name == "bias":
                        param.zero_()
                    else:
                        fill(param, name, seed=seed, std=tower.initializer_range)
                elif isinstance(module, RMSNorm):
                    param.fill_(0.0 if module.zero_centered else 1.0)
                elif isinstance(module, ResidualGate):
                    param.fill_(1.0)
                elif isinstance(module, SigmoidTopKRouter) and param_name == "expert_bias":
                    param.zero_()
                else:
                    fill(param, name, seed=seed, std=self.config.initializer_range)
        embedding = self.model.language_model.embed_tokens
        if embedding is not None and embedding.padding_idx is not None:
            embedding.weight[embedding.padding_idx].zero_()


class SoftCappedLinear(nn.Linear):
    """The LM head: a linear map without bias whose logits are soft-capped. The cap is an attribute of the head
    (``softcap``) so that a loss computing the head's logits itself applies it too."""

    def __init__(self, in_features: int, out_features: int, softcap: float) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.softcap = softcap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().forward(h), self.softcap)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(logits / cap), evaluated in fp32 (or fp64) and returned in the logits' dtype."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    return (cap * torch.tanh(logits.to(compute) / cap)).to(logits.dtype)


def build_muse_spark(config: MuseSparkConfig, *, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32, seed: int | None = 0,
                     kernels: KernelOptions = KernelOptions()) -> MuseSparkForCausalLM:
    """Build on the meta device, materialise on ``device``, initialise; ``seed=None`` leaves memory uninitialised.

    The router weight, expert bias and residual gates stay fp32 whatever ``dtype`` is (see ``KeepFP32``).
    """
    return build_on_meta(lambda: MuseSparkForCausalLM(config, kernels), device=device, dtype=dtype, seed=seed)
