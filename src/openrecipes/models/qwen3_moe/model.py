"""Qwen3-MoE decoder in pure PyTorch. Parameter names follow transformers' Qwen3MoeForCausalLM, except the
experts, which are grouped 3-D tensors (``mlp.experts.{gate,up,down}_proj``). A layer the config makes dense
(``mlp_only_layers``, ``decoder_sparse_step``) holds a gated MLP instead; with ``sliding_window`` every layer attends
to that many tokens back.

Legend: B rows, T tokens per row, D hidden, H query heads, K key/value heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openrecipes.models.common.attention import Documents, attention
from openrecipes.models.common.decoder import decoder_stack, positions
from openrecipes.models.common.init import SeededFill, build_on_meta, fill_seeded_normal_
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.mlp import GatedMLP
from openrecipes.models.common.moe import SparseMoeBlock
from openrecipes.models.common.norms import RMSNorm
from openrecipes.models.common.rope import apply_rope, rope_angles
from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig


class Qwen3MoeAttention(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, kernels: KernelOptions) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.window = config.sliding_window
        self.backend = kernels.attention  # a name, or a callable parallelism plugs in (context parallelism)
        bias = config.attention_bias
        d, dh = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * dh, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * dh, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * dh, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=bias)
        self.q_norm = RMSNorm(dh, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(dh, eps=config.rms_norm_eps)

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        rows, tokens, _ = x_BTD.shape
        # Heads are inferred (-1) so tensor parallelism can shard the projections without touching this code.
        q = self.q_norm(self.q_proj(x_BTD).view(rows, tokens, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BTD).view(rows, tokens, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BTD).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, angles_BTF), apply_rope(k, angles_BTF)
        out = attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim), documents=documents, window=self.window,
                        backend=self.backend)
        return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, kernels: KernelOptions, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Qwen3MoeAttention(config, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.dense = not config.is_moe_layer(index)  # the sharding plan reads it (ShardingPlan.dense_layer)
        self.mlp = (GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act) if self.dense
                    else SparseMoeBlock(hidden_size=config.hidden_size, num_experts=config.num_experts,
                                        top_k=config.num_experts_per_tok, ffn_size=config.moe_intermediate_size,
                                        normalize_top_k=config.norm_topk_prob, activation=config.hidden_act,
                                        kernels=kernels))

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        h = x_BTD + self.self_attn(self.input_layernorm(x_BTD), angles_BTF, documents)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3MoeBackbone(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, kernels: KernelOptions) -> None:
        super().__init__()
        # padding_idx: the pad token's row gets no gradient, as in transformers
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size,
                                                              padding_idx=config.pad_token_id)
        # A dict keyed by layer index keeps parameter names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): Qwen3MoeDecoderLayer(config, kernels, i)
                                     for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3MoeForCausalLM(nn.Module):
    """``forward(input_ids, position_ids=None, documents=None) -> logits (B, T, V)``.

    A pipeline stage may drop ``model.embed_tokens`` (then the input is hidden states) or ``model.norm`` and
    ``lm_head`` (then the output is hidden states).
    """

    def __init__(self, config: Qwen3MoeConfig, kernels: KernelOptions = KernelOptions()) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3MoeBackbone(config, kernels)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None, *, layers: range | None = None) -> torch.Tensor:
        """``layers``: run only these decoder layers (global indices; an interleaved pipeline chunk). The embedding
        runs before layer 0 and the final norm and head after the last layer, so a chunk in the middle takes and
        gives hidden states even where this module holds the embedding or the head for another chunk."""
        position_ids = positions(input_ids, position_ids)
        angles = rope_angles(position_ids, self.config.head_dim, self.config.rope_theta)
        return decoder_stack(self, input_ids, angles, documents, layers)[0]

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0, fill: SeededFill = fill_seeded_normal_) -> None:
        """Initialise every parameter (after ``to_empty`` from the meta device). Matrices ~ N(0, initializer_range),
        the pad token's embedding row 0 (as transformers initialises it).

        Each tensor draws from its own generator seeded by (seed, name), so a pipeline stage that holds only
        some layers gets exactly the values the whole model would have (``fill`` slices sharded tensors).
        """
        for name, param in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                fill(param, name, seed=seed, std=self.config.initializer_range)
        embedding = self.model.embed_tokens
        if embedding is not None and embedding.padding_idx is not None:
            embedding.weight[embedding.padding_idx].zero_()


def build_qwen3_moe(config: Qwen3MoeConfig, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int | None = 0,
                    kernels: KernelOptions = KernelOptions()) -> Qwen3MoeForCausalLM:
    """Build on the meta device, materialise on ``device``, initialise; ``seed=None`` leaves memory uninitialised."""
    return build_on_meta(lambda: Qwen3MoeForCausalLM(config, kernels), device=device, dtype=dtype, seed=seed)
