"""gpt-oss in pure PyTorch: attention with biases and per-head sinks over alternating sliding and full layers, plain
or YaRN RoPE, and MoE layers whose router has a bias and softmaxes the top-k logits, and whose experts have biases
and a clamped SwiGLU (common/moe.py ``ClampedSwiGLU``).

Legend: B batch rows, T tokens, D hidden, H query heads, K key/value heads, E experts.

Not supported, refused at the first forward by name: tensor parallelism of the attention (the sinks are per head and
are not split), context parallelism (its attention backend has no sink term), expert parallelism (its dispatcher
runs neither the expert biases nor the clamped SwiGLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.attention import Documents, attention
from openrecipes.models.common.decoder import decoder_stack, positions
from openrecipes.models.common.init import SeededFill, build_on_meta, fill_seeded_normal_
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.moe import ClampedSwiGLU, GroupedExperts, LocalTokenDispatcher, Routing, balanced
from openrecipes.models.common.norms import RMSNorm
from openrecipes.models.common.rope import apply_rope, rope_angles
from openrecipes.models.gpt_oss.config import GptOssConfig


class GptOssAttention(nn.Module):
    def __init__(self, config: GptOssConfig, kernels: KernelOptions, index: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.window = config.window(index)
        self.backend = kernels.attention
        self.rope_factor = config.rope_scaling.cos_sin_factor
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        rows, tokens, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTD).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTD).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, angles_BTF), apply_rope(k, angles_BTF)
        if self.rope_factor != 1.0:  # YaRN scales cos and sin: both rotated halves, so q and k, by the factor
            q, k = q * self.rope_factor, k * self.rope_factor
        out = attention(q, k, v, scale=self.head_dim ** -0.5, documents=documents, window=self.window,
                        backend=self.backend, sinks=self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))


class GptOssRouter(nn.Module):
    """Logits x Wᵀ + b; the top-k logits, softmaxed among themselves, are the gating weights."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, balanced_routing: bool = False) -> None:
        super().__init__()
        self.top_k, self.balanced_routing = top_k, balanced_routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x_TD: torch.Tensor) -> Routing:
        logits_TE = F.linear(x_TD, self.weight, self.bias)
        top_TK, experts_TK = torch.topk(logits_TE, self.top_k, dim=-1)
        weights_TK = torch.softmax(top_TK, dim=-1)  # in the logits' dtype, as transformers does
        routing = Routing(experts_TK=experts_TK, weights_TK=weights_TK)
        return balanced(routing, self.weight.shape[0]) if self.balanced_routing else routing


class GptOssMoeBlock(nn.Module):
    def __init__(self, config: GptOssConfig, kernels: KernelOptions) -> None:
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                                   balanced_routing=kernels.balanced_routing)
        self.experts = GroupedExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                      backend=kernels.experts, bias=True,
                                      glu=ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit))
        self.token_dispatcher = LocalTokenDispatcher()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if type(self.token_dispatcher) is not LocalTokenDispatcher:
            raise NotImplementedError("gpt-oss: expert parallelism is not supported (its dispatcher runs neither "
                                      "the expert biases nor the clamped SwiGLU)")
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        return self.token_dispatcher(x_TD, self.router(x_TD), self.experts).reshape(x_BTD.shape)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: GptOssConfig, kernels: KernelOptions, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = GptOssAttention(config, kernels, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = GptOssMoeBlock(config, kernels)

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        h = x_BTD + self.self_attn(self.input_layernorm(x_BTD), angles_BTF, documents)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssBackbone(nn.Module):
    def __init__(self, config: GptOssConfig, kernels: KernelOptions) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size,
                                                              padding_idx=config.pad_token_id)
        # keyed by layer index: parameter names stay stable when pipeline stages drop layers
        self.layers = nn.ModuleDict({str(i): GptOssDecoderLayer(config, kernels, i)
                                     for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GptOssForCausalLM(nn.Module):
    """``forward(input_ids, position_ids=None, documents=None, *, layers=None) -> logits (B, T, V)``; a pipeline
    stage may drop the embedding (input: hidden states) or the final norm and head (output: hidden states)."""

    def __init__(self, config: GptOssConfig, kernels: KernelOptions = KernelOptions()) -> None:
        super().__init__()
        self.config = config
        self.model = GptOssBackbone(config, kernels)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None, *, layers: range | None = None) -> torch.Tensor:
        position_ids = positions(input_ids, position_ids)
        angles = rope_angles(position_ids, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling)
        return decoder_stack(self, input_ids, angles, documents, layers)[0]

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0, fill: SeededFill = fill_seeded_normal_) -> None:
        """As transformers initialises gpt-oss: matrices, sinks and the router's bias ~ N(0, initializer_range),
        norms 1, every other bias 0, the pad token's embedding row 0. Each tensor draws from a generator seeded by
        (seed, name), so a pipeline stage gets exactly the values the whole model would have."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            elif name.endswith("bias") and not name.endswith("router.bias"):
                param.zero_()
            else:
                fill(param, name, seed=seed, std=self.config.initializer_range)
        embedding = self.model.embed_tokens
        if embedding is not None and embedding.padding_idx is not None:
            embedding.weight[embedding.padding_idx].zero_()


def build_gpt_oss(config: GptOssConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  seed: int | None = 0, kernels: KernelOptions = KernelOptions()) -> GptOssForCausalLM:
    """Build on the meta device, materialise on ``device``, initialise; ``seed=None`` leaves memory uninitialised."""
    return build_on_meta(lambda: GptOssForCausalLM(config, kernels), device=device, dtype=dtype, seed=seed)
