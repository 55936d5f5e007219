"""Qwen3.5-MoE text decoder in pure PyTorch. Parameter names follow transformers' Qwen3_5MoeForCausalLM, except the
routed experts, which are grouped 3-D tensors (``mlp.experts.{gate,up,down}_proj``).

One layer (pre-norm): h = x + Mixer(RMSNorm(x)); out = h + MoE(RMSNorm(h)). Every norm outside the linear
attention is zero-centred, (1 + w) x / rms(x), as transformers' Qwen3_5MoeRMSNorm (its weights start at 0).
Mixer, by ``layer_types``:
- ``linear_attention`` (Gated DeltaNet, ``linear_attn``): in_proj_qkv -> causal depthwise convolution -> SiLU ->
  q, k, v heads; q and k L2-normalised, q scaled by 1/sqrt(key width); decay g = -exp(A_log) softplus(a + dt_bias),
  write strength beta = sigmoid(b); the gated delta rule (delta_rule.py); an RMSNorm per value head (plain weight)
  times SiLU(z); out_proj. Query/key heads are shared by consecutive value heads.
- ``full_attention`` (``self_attn``): q_proj gives each head's query and output gate side by side; zero-centred
  RMSNorm on query and key heads; RoPE on the first ``rotary_dim`` of each head; output * sigmoid(gate) -> o_proj.
MoE: softmax top-k routed experts, renormalised, plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

Legend: B rows, T tokens, D hidden, H heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.activations import ACTIVATIONS
from openrecipes.models.common.attention import Documents, attention
from openrecipes.models.common.decoder import decoder_stack, positions
from openrecipes.models.common.init import SeededFill, build_on_meta, fill_seeded_normal_, seeded_uniform
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.mlp import GatedMLP
from openrecipes.models.common.moe import GroupedExperts, LocalTokenDispatcher, SoftmaxTopKRouter
from openrecipes.models.common.norms import RMSNorm
from openrecipes.models.common.rope import apply_partial_rope, rope_angles
from openrecipes.models.qwen3_5_moe.config import Qwen35MoeConfig
from openrecipes.models.qwen3_5_moe.delta_rule import (DocumentBatch, causal_depthwise_conv,
                                                       gated_delta_rule_chunked, l2_normalize)

_NOT_SPLIT = ("Qwen3.5-MoE's linear-attention layers (Gated DeltaNet) run whole on one process: their state runs "
              "along the sequence and their in_proj_qkv packs q, k and v; {what} is not supported for them")


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer. ``num_heads``/``num_kv_heads``: value and query/key heads; it holds no
    q/k/v/o projection of the sharding plan (None), and refuses tensor and context parallelism by name."""

    q_proj = k_proj = v_proj = o_proj = None  # ShardingPlan.attention_tp names: absent here

    def __init__(self, config: Qwen35MoeConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.linear_num_value_heads, config.linear_num_key_heads
        self.head_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.activation = config.hidden_act
        self._backend = "auto"
        d, keys = config.hidden_size, self.num_kv_heads * self.head_dim
        values = self.num_heads * self.value_dim
        self.in_proj_qkv = nn.Linear(d, 2 * keys + values, bias=False)
        self.in_proj_z = nn.Linear(d, values, bias=False)
        self.in_proj_b = nn.Linear(d, self.num_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_heads, bias=False)
        self.conv1d = nn.Conv1d(2 * keys + values, 2 * keys + values, config.linear_conv_kernel_dim,
                                groups=2 * keys + values, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.norm = RMSNorm(self.value_dim, eps=config.rms_norm_eps)  # plain weight, gated by SiLU(z) below
        self.out_proj = nn.Linear(values, d, bias=False)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value) -> None:
        if callable(value):  # context parallelism or an attention-core recompute wrapper
            raise ValueError(_NOT_SPLIT.format(what="a parallel or recomputed attention core (layout.cp, "
                                                    "recompute.granularity attention_core/full_keep_attention)"))
        self._backend = value

    def register_forward_pre_hook(self, *args, **kwargs):
        # tensor parallelism gathers each attention module's input through a pre-hook: its one use on this module
        raise ValueError(_NOT_SPLIT.format(what="tensor parallelism (layout.tp)"))

    def _core(self, qkv_BTC: torch.Tensor, a_BTH: torch.Tensor, b_BTH: torch.Tensor) -> torch.Tensor:
        """Convolution and delta rule over whole rows (or documents regrouped as rows): (B, T, H, Dv)."""
        rows, tokens, _ = qkv_BTC.shape
        mixed = ACTIVATIONS[self.activation](causal_depthwise_conv(qkv_BTC, self.conv1d.weight))
        keys = qkv_BTC.shape[-1] - self.num_heads * self.value_dim  # q and k together; inferred, not stored
        q, k, v = mixed.split([keys // 2, keys // 2, mixed.shape[-1] - keys], dim=-1)
        q, k = (x.reshape(rows, tokens, -1, self.head_dim) for x in (q, k))
        v = v.reshape(rows, tokens, -1, self.value_dim)
        share = v.shape[2] // q.shape[2]  # consecutive value heads share one query/key head
        q, k = (l2_normalize(x.float() if x.dtype != torch.float64 else x).repeat_interleave(share, dim=2)
                for x in (q, k))
        q = q / math.sqrt(self.head_dim)
        beta = torch.sigmoid(b_BTH)
        wide = torch.promote_types(a_BTH.dtype, torch.float32)  # exp(A_log) in fp32 at least (fp16 overflows)
        g = -self.A_log.to(wide).exp() * F.softplus(a_BTH.to(wide) + self.dt_bias.to(wide))
        out = gated_delta_rule_chunked(*(x.transpose(1, 2) for x in (q, k, v, g, beta)))
        return out.transpose(1, 2).to(qkv_BTC.dtype)

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        rows, tokens, _ = x_BTD.shape
        qkv, a, b = self.in_proj_qkv(x_BTD), self.in_proj_a(x_BTD), self.in_proj_b(x_BTD)
        if documents is not None and not documents.whole_rows(rows, tokens):
            # each document from a zero state and zero convolution history, computed as if alone (delta_rule.py)
            batch = DocumentBatch.build(documents.to(x_BTD.device))
            out = batch.scatter(self._core(batch.gather(qkv), batch.gather(a), batch.gather(b)), rows, tokens)
        else:
            out = self._core(qkv, a, b)
        z = self.in_proj_z(x_BTD).view(rows, tokens, -1, self.value_dim)
        gate = F.silu(z.to(torch.promote_types(z.dtype, torch.float32)))
        out = (self.norm(out) * gate).to(x_BTD.dtype)
        return self.out_proj(out.reshape(rows, tokens, -1))


class GatedAttention(nn.Module):
    """Full softmax attention with a per-head sigmoid output gate and partial RoPE."""

    def __init__(self, config: Qwen35MoeConfig, kernels: KernelOptions) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.rotary_dim = config.head_dim, config.rotary_dim
        self.backend = kernels.attention  # a name, or a callable parallelism plugs in (context parallelism)
        d, dh, bias = config.hidden_size, config.head_dim, config.attention_bias
        # per head: its query then its gate (transformers' layout), so a split by heads keeps each pair together
        self.q_proj = nn.Linear(d, self.num_heads * dh * 2, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * dh, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * dh, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=bias)
        self.q_norm = RMSNorm(dh, eps=config.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(dh, eps=config.rms_norm_eps, zero_centered=True)

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        rows, tokens, _ = x_BTD.shape
        q, gate = self.q_proj(x_BTD).view(rows, tokens, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q).transpose(1, 2), angles_BTF, self.rotary_dim)
        k = self.k_norm(self.k_proj(x_BTD).view(rows, tokens, -1, self.head_dim))
        k = apply_partial_rope(k.transpose(1, 2), angles_BTF, self.rotary_dim)
        v = self.v_proj(x_BTD).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        out = attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim), documents=documents, backend=self.backend)
        out = out.transpose(1, 2).reshape(rows, tokens, -1) * torch.sigmoid(gate.reshape(rows, tokens, -1))
        return self.o_proj(out)


class SharedExpertMoe(nn.Module):
    """Routed experts (softmax top-k, renormalised) plus a shared expert under a sigmoid gate. ``token_dispatcher``
    is swapped by expert parallelism (not an nn.Module attribute)."""

    def __init__(self, config: Qwen35MoeConfig, kernels: KernelOptions) -> None:
        super().__init__()
        d = config.hidden_size
        # transformers' Qwen3.5 router always renormalises the top-k softmax weights (no norm_topk_prob field)
        self.gate = SoftmaxTopKRouter(d, config.num_experts, config.num_experts_per_tok, normalize_top_k=True,
                                      balanced_routing=kernels.balanced_routing)
        self.experts = GroupedExperts(config.num_experts, d, config.moe_intermediate_size,
                                      activation=config.hidden_act, backend=kernels.experts)
        self.shared_expert = GatedMLP(d, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)
        self.token_dispatcher = LocalTokenDispatcher()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        routed = self.token_dispatcher(x_TD, self.gate(x_TD), self.experts)
        shared = torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return (routed + shared).reshape(x_BTD.shape)


class Qwen35MoeDecoderLayer(nn.Module):
    def __init__(self, config: Qwen35MoeConfig, index: int, kernels: KernelOptions) -> None:
        super().__init__()
        self.full_attention = config.is_full_attention(index)  # the sharding plan reads it (family.py)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=True)
        if self.full_attention:
            self.self_attn = GatedAttention(config, kernels)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=True)
        self.mlp = SharedExpertMoe(config, kernels)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.full_attention else self.linear_attn

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        h = x_BTD + self.mixer(self.input_layernorm(x_BTD), angles_BTF, documents)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen35MoeBackbone(nn.Module):
    def __init__(self, config: Qwen35MoeConfig, kernels: KernelOptions) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size,
                                                              padding_idx=config.pad_token_id)
        # a dict keyed by layer index keeps parameter names stable when pipeline stages drop layers
        self.layers = nn.ModuleDict({str(i): Qwen35MoeDecoderLayer(config, i, kernels)
                                     for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=True)


class Qwen35MoeForCausalLM(nn.Module):
    """``forward(input_ids, position_ids=None, documents=None) -> logits (B, T, V)``. A pipeline stage may drop
    ``model.embed_tokens`` (input: hidden states) or ``model.norm`` and ``lm_head`` (output: hidden states)."""

    def __init__(self, config: Qwen35MoeConfig, kernels: KernelOptions = KernelOptions()) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen35MoeBackbone(config, kernels)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None, *, layers: range | None = None) -> torch.Tensor:
        """``layers``: run only these decoder layers (global indices; an interleaved pipeline chunk)."""
        position_ids = positions(input_ids, position_ids)
        # the rotated width's own frequencies, 1 / theta^(2i / R), as transformers computes them
        angles = rope_angles(position_ids, self.config.rotary_dim, self.config.rope_theta)
        return decoder_stack(self, input_ids, angles, documents, layers)[0]

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0, fill: SeededFill = fill_seeded_normal_) -> None:
        """As transformers initialises them: matrices ~ N(0, initializer_range) (each from its own generator seeded
        by (seed, name)); zero-centred norms 0, the gated norm 1, biases 0, dt_bias 1, A_log = log U(0.01, 16),
        the pad token's embedding row 0."""
        for name, param in self.named_parameters():
            if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                param.fill_(1.0)
            elif "norm" in name or name.endswith(".bias"):
                param.zero_()
            elif name.endswith("A_log"):  # per-head decay rates, whole on every rank
                param.copy_(seeded_uniform(param.shape, name, seed=seed, bound=7.995, device=param.device)
                            .add_(8.005).log_())
            else:
                fill(param, name, seed=seed, std=self.config.initializer_range)
        embedding = self.model.embed_tokens
        if embedding is not None and embedding.padding_idx is not None:
            embedding.weight[embedding.padding_idx].zero_()


def build_qwen3_5_moe(config: Qwen35MoeConfig, *, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32, seed: int | None = 0,
                      kernels: KernelOptions = KernelOptions()) -> Qwen35MoeForCausalLM:
    """Build on the meta device, materialise on ``device``, initialise; ``seed=None`` leaves memory uninitialised."""
    return build_on_meta(lambda: Qwen35MoeForCausalLM(config, kernels), device=device, dtype=dtype, seed=seed)
