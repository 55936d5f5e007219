"""GLM-4.5-MoE decoder in pure PyTorch. Parameter names follow transformers' Glm4MoeForCausalLM, except the routed
experts, which are grouped 3-D tensors (``mlp.experts.{gate,up,down}_proj``).

One layer (pre-norm): h = x + Attention(RMSNorm(x)); out = h + FFN(RMSNorm(h)), where FFN is a dense gated MLP in
the first ``first_k_dense_replace`` layers and, after them, routed plus shared experts under DeepSeek-V3's
group-limited sigmoid router (models/common/group_routing.py).
Attention: grouped-query heads of ``head_dim``; q/k/v carry biases under ``attention_bias`` (o_proj never does);
with ``use_qk_norm`` an RMSNorm over each query and key head; RoPE (rotate-half pairing) on the first
``rotary_dim = head_dim * partial_rotary_factor`` dimensions of each head, the rest passed through; scores scaled
by 1/sqrt(head_dim).

Legend: B rows, T tokens per row, D hidden, H query heads, Dh head dim, R rotary width, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openrecipes.models.common.attention import Documents, attention
from openrecipes.models.common.decoder import decoder_stack, positions
from openrecipes.models.common.group_routing import GroupLimitedMoe
from openrecipes.models.common.init import SeededFill, build_on_meta, fill_seeded_normal_
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.mlp import GatedMLP
from openrecipes.models.common.norms import RMSNorm
from openrecipes.models.common.rope import apply_partial_rope as partial_rope
from openrecipes.models.common.rope import rope_angles
from openrecipes.models.glm4_moe.config import Glm4MoeConfig


class Glm4MoeAttention(nn.Module):
    def __init__(self, config: Glm4MoeConfig, kernels: KernelOptions) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.rotary_dim = config.head_dim, config.rotary_dim
        self.backend = kernels.attention  # a name, or a callable parallelism plugs in (context parallelism)
        d, dh, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * dh, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * dh, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * dh, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=False)  # transformers: no bias whatever attention_bias
        self.q_norm = RMSNorm(dh, eps=config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(dh, eps=config.rms_norm_eps) if config.use_qk_norm else None

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        rows, tokens, _ = x_BTD.shape
        # heads are inferred (-1) so tensor parallelism can split the projections without touching this code
        q = self.q_proj(x_BTD).view(rows, tokens, -1, self.head_dim)
        k = self.k_proj(x_BTD).view(rows, tokens, -1, self.head_dim)
        v = self.v_proj(x_BTD).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = partial_rope(q.transpose(1, 2), angles_BTF, self.rotary_dim)
        k = partial_rope(k.transpose(1, 2), angles_BTF, self.rotary_dim)
        out = attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim), documents=documents, backend=self.backend)
        return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))


class Glm4MoeDecoderLayer(nn.Module):
    def __init__(self, config: Glm4MoeConfig, index: int, kernels: KernelOptions) -> None:
        super().__init__()
        self.dense = not config.is_moe_layer(index)  # the sharding plan reads it (ShardingPlan.dense_layer)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Glm4MoeAttention(config, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = (GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act) if self.dense
                    else GroupLimitedMoe(config, kernels))

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        h = x_BTD + self.self_attn(self.input_layernorm(x_BTD), angles_BTF, documents)
        return h + self.mlp(self.post_attention_layernorm(h))


class Glm4MoeBackbone(nn.Module):
    def __init__(self, config: Glm4MoeConfig, kernels: KernelOptions) -> None:
        super().__init__()
        # padding_idx: the pad token's row gets no gradient, as in transformers
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size,
                                                              padding_idx=config.pad_token_id)
        # a dict keyed by layer index keeps parameter names stable when pipeline stages drop layers
        self.layers = nn.ModuleDict({str(i): Glm4MoeDecoderLayer(config, i, kernels)
                                     for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Glm4MoeForCausalLM(nn.Module):
    """``forward(input_ids, position_ids=None, documents=None) -> logits (B, T, V)``.

    A pipeline stage may drop ``model.embed_tokens`` (then the input is hidden states) or ``model.norm`` and
    ``lm_head`` (then the output is hidden states).
    """

    def __init__(self, config: Glm4MoeConfig, kernels: KernelOptions = KernelOptions()) -> None:
        super().__init__()
        self.config = config
        self.model = Glm4MoeBackbone(config, kernels)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None, *, layers: range | None = None) -> torch.Tensor:
        """``layers``: run only these decoder layers (global indices; an interleaved pipeline chunk). The embedding
        runs before layer 0 and the final norm and head after the last layer."""
        position_ids = positions(input_ids, position_ids)
        # the frequencies of the rotated width alone: 1 / theta^(2i / R), as transformers computes them
        angles = rope_angles(position_ids, self.config.rotary_dim, self.config.rope_theta)
        return decoder_stack(self, input_ids, angles, documents, layers)[0]

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0, fill: SeededFill = fill_seeded_normal_) -> None:
        """Matrices ~ N(0, initializer_range), each from its own generator seeded by (seed, name); norms 1, biases
        and the routers' correction biases 0, the pad token's embedding row 0 (as transformers initialises them)."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
                param.zero_()
            else:
                fill(param, name, seed=seed, std=self.config.initializer_range)
        embedding = self.model.embed_tokens
        if embedding is not None and embedding.padding_idx is not None:
            embedding.weight[embedding.padding_idx].zero_()


def build_glm4_moe(config: Glm4MoeConfig, *, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int | None = 0,
                   kernels: KernelOptions = KernelOptions()) -> Glm4MoeForCausalLM:
    """Build on the meta device, materialise on ``device``, initialise; ``seed=None`` leaves memory uninitialised.
    The router weights and correction biases stay fp32 whatever ``dtype`` is (``KeepFP32``)."""
    return build_on_meta(lambda: Glm4MoeForCausalLM(config, kernels), device=device, dtype=dtype, seed=seed)
