"""DeepSeek-V3 decoder in pure PyTorch. Parameter names follow transformers' DeepseekV3ForCausalLM, except the
routed experts, which are grouped 3-D tensors (``mlp.experts.{gate,up,down}_proj``).

One layer (pre-norm): h = x + MLA(RMSNorm(x)); out = h + FFN(RMSNorm(h)), where FFN is a dense gated MLP in the
first ``first_k_dense_replace`` layers and, after them, routed experts plus shared experts (a gated MLP every token
takes).
MLA (multi-head latent attention): queries from hidden -> q_lora_rank (RMSNorm) -> heads x (nope + rope) (or one
projection when q_lora_rank is null); keys and values from hidden -> kv_lora_rank (RMSNorm) -> heads x (nope + v),
and one rope part of the key shared by every head, taken from the hidden state beside the latent. RoPE rotates the
rope parts only; scores are over nope + rope, scaled by 1/sqrt(nope + rope).
Router and MoE block (group-limited sigmoid routing with the correction bias, routed plus shared experts):
models/common/group_routing.py, shared with GLM-4.5.

Multi-token prediction (DeepSeek-V3 report §2.2; ``DeepseekV3MTPLayer``), held when ``config.mtp_layers``: depth
k = 1..D reads the representation h^(k-1) of the depth before (depth 0: the main model's last hidden state after its
final norm, what the LM head reads) and the embedding of the token k places ahead, and computes
h'_i = eh_proj([enorm(Emb(t_(i+k))); hnorm(h^(k-1)_i)]) (the embedding first, as Megatron-LM and vLLM read the
published ``eh_proj``), then one decoder layer, then ``shared_head.norm``: that is h^k, which the main model's LM head
turns into the depth's logits (predicting t_(i+k+1)) and which depth k+1 reads. The embedding and the head are the
main model's (the checkpoint's copies under the MTP layer's name are checked equal on import: models/deepseek_v3/hf.py).

Legend: B rows, T tokens per row, D hidden, H heads, E routed experts, K experts per token, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from openrecipes.models.common.attention import Documents, attention
from openrecipes.models.common.decoder import decoder_stack, positions
from openrecipes.models.common.group_routing import GroupLimitedMoe
from openrecipes.models.common.init import SeededFill, build_on_meta, fill_seeded_normal_
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.mlp import GatedMLP
from openrecipes.models.common.norms import RMSNorm
from openrecipes.models.common.rope import apply_rope, rope_angles
from openrecipes.models.deepseek_v3.config import DeepseekV3Config

# transformers builds the latent norms (q_a_layernorm, kv_a_layernorm) with its RMSNorm's default epsilon whatever
# config.rms_norm_eps says (modeling_deepseek_v3: DeepseekV3RMSNorm(q_lora_rank)); the other norms take the config's
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """The widths tensor parallelism splits are read from ``num_heads`` and ``num_kv_heads`` (keys and values come
    per head from the latent, so both are H); ``head_dim`` is the query/key width of a head."""

    def __init__(self, config: DeepseekV3Config, kernels: KernelOptions) -> None:
        super().__init__()
        d, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.num_heads = self.num_kv_heads = heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.head_dim = config.qk_head_dim
        self.kv_rank = config.kv_lora_rank
        self.pairing = "adjacent" if config.rope_interleave else "half"
        self.rope_factor, self.softmax_scale = config.rope_scaling.cos_sin_factor, config.softmax_scale
        self.backend = kernels.attention  # a name, or a callable parallelism plugs in (context parallelism)
        if config.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(d, heads * self.head_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, d, bias=bias)

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        rows, tokens, _ = x_BTD.shape
        if self.q_proj is not None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        # heads are inferred (-1) so tensor parallelism can split the head projections without touching this code
        q_nope, q_rope = q.view(rows, tokens, -1, self.head_dim).transpose(1, 2).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(rows, tokens, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, angles_BTF, pairing=self.pairing)
        k_rope = apply_rope(k_rope[:, None], angles_BTF, pairing=self.pairing)
        if self.rope_factor != 1.0:  # YaRN's cos/sin factor (plain RoPE, and YaRN as DeepSeek-V3 publishes it: 1)
            q_rope, k_rope = q_rope * self.rope_factor, k_rope * self.rope_factor
        k_rope = k_rope.expand(-1, k_nope.shape[1], -1, -1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        out = attention(q, k, v, scale=self.softmax_scale, documents=documents, backend=self.backend)
        return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, index: int, kernels: KernelOptions) -> None:
        super().__init__()
        self.dense = not config.is_moe_layer(index)  # the sharding plan reads it (ShardingPlan.dense_layer)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(config, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = (GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act) if self.dense
                    else GroupLimitedMoe(config, kernels))

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        h = x_BTD + self.self_attn(self.input_layernorm(x_BTD), angles_BTF, documents)
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    """The MTP layer's final norm (``shared_head.norm``); the head it feeds is the main model's ``lm_head``."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """One multi-token-prediction depth: a decoder layer (its modules under the same names, as the checkpoint's
    ``model.layers.{num_hidden_layers + k - 1}``) with its input norms and projection and its final norm."""

    def __init__(self, config: DeepseekV3Config, index: int, kernels: KernelOptions) -> None:
        super().__init__(config, index, kernels)
        d = config.hidden_size
        self.enorm = RMSNorm(d, eps=config.rms_norm_eps)  # of the embedding
        self.hnorm = RMSNorm(d, eps=config.rms_norm_eps)  # of the previous depth's representation
        self.eh_proj = nn.Linear(2 * d, d, bias=False)  # input features: [enorm(embedding); hnorm(hidden)]
        self.shared_head = SharedHead(config)

    def forward(self, h_BTD: torch.Tensor, embedded_BTD: torch.Tensor, angles_BTF: torch.Tensor,
                documents: Documents | None) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embedded_BTD), self.hnorm(h_BTD)), dim=-1))
        return self.shared_head.norm(super().forward(x, angles_BTF, documents))


class DeepseekV3Backbone(nn.Module):
    def __init__(self, config: DeepseekV3Config, kernels: KernelOptions) -> None:
        super().__init__()
        # padding_idx: the pad token's row gets no gradient, as in transformers
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size,
                                                              padding_idx=config.pad_token_id)
        # a dict keyed by layer index keeps parameter names stable when pipeline stages drop layers
        self.layers = nn.ModuleDict({str(i): DeepseekV3DecoderLayer(config, i, kernels)
                                     for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # keyed by global layer index like ``layers`` (the checkpoint's model.layers.{i}); None: none held
        self.mtp_layers = nn.ModuleDict({str(i): DeepseekV3MTPLayer(config, i, kernels)
                                         for i in config.mtp_layer_indices()}) if config.mtp_layers else None


class DeepseekV3ForCausalLM(nn.Module):
    """``forward(input_ids, position_ids=None, documents=None) -> logits (B, T, V)``.

    A pipeline stage may drop ``model.embed_tokens`` (then the input is hidden states) or ``model.norm`` and
    ``lm_head`` (then the output is hidden states).
    """

    def __init__(self, config: DeepseekV3Config, kernels: KernelOptions = KernelOptions()) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Backbone(config, kernels)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: Documents | None = None, *, layers: range | None = None,
                mtp: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """``layers``: run only these decoder layers (global indices; an interleaved pipeline chunk). ``mtp``: also
        run the MTP layers and return (output, [h^1 .. h^D]), each (B, T, D): what the LM head reads at each depth
        (the module docstring); position i of depth k predicts token i + k + 1."""
        if mtp and (self.model.mtp_layers is None or layers is not None):
            raise ValueError("mtp: the model holds no multi-token-prediction layer (config.mtp_layers is 0), or runs "
                             "a part of its layers")
        position_ids = positions(input_ids, position_ids)
        angles = rope_angles(position_ids, self.config.qk_rope_head_dim, self.config.rope_theta,
                             self.config.rope_scaling)
        out, h = decoder_stack(self, input_ids, angles, documents, layers)
        return (out, self._mtp_hidden(h, input_ids, angles, documents)) if mtp else out

    def _mtp_hidden(self, h_BTD: torch.Tensor, input_ids: torch.Tensor, angles_BTF: torch.Tensor,
                    documents: Documents | None) -> list[torch.Tensor]:
        hidden, ids = [], input_ids
        for layer in self.model.mtp_layers.values():
            # depth k reads token i + k at position i; the k positions that wrap around have no target (weight 0)
            ids = torch.roll(ids, -1, dims=1)
            h_BTD = layer(h_BTD, self.model.embed_tokens(ids), angles_BTF, documents)
            hidden.append(h_BTD)
        return hidden

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


def build_deepseek_v3(config: DeepseekV3Config, *, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32, seed: int | None = 0,
                      kernels: KernelOptions = KernelOptions()) -> DeepseekV3ForCausalLM:
    """Build on the meta device, materialise on ``device``, initialise; ``seed=None`` leaves memory uninitialised.
    The router weights and correction biases stay fp32 whatever ``dtype`` is (``KeepFP32``)."""
    return build_on_meta(lambda: DeepseekV3ForCausalLM(config, kernels), device=device, dtype=dtype, seed=seed)
