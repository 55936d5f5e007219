"""Build transformers' Qwen3MoeForCausalLM with random weights and save it, for parity tests."""

from __future__ import annotations

import torch

HF_SMALL_CONFIGS = {
    # num_attention_heads * head_dim (4*24 = 96) != hidden_size (64); GQA 2:1
    "wide_heads": dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    # norm_topk_prob false, 4:1 GQA, odd expert count
    "unnormalized_topk": dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
                              num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                              num_experts=5, num_experts_per_tok=3, norm_topk_prob=False),
    # no GQA, attention bias, top-1 (unnormalised: a renormalised top-1 weight is always 1, leaving no router gradient)
    "mha_bias_top1": dict(vocab_size=80, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                          num_experts=4, num_experts_per_tok=1, norm_topk_prob=False, attention_bias=True),
    # GeGLU experts: hidden_act is honoured (it was once read and computed as SiLU)
    "gelu": dict(vocab_size=99, hidden_size=32, intermediate_size=37, moe_intermediate_size=12,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, hidden_act="gelu"),
    # a pad token: transformers' embedding has padding_idx, so that row gets no gradient
    "pad_token": dict(vocab_size=64, hidden_size=32, intermediate_size=37, moe_intermediate_size=12,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=5),
}


def make_hf_model(name: str, seed: int = 0, std: float = 0.08, **overrides):
    """transformers' Qwen3MoeForCausalLM for ``HF_SMALL_CONFIGS[name]`` (``overrides`` replace config keys)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    keys = dict(rope_theta=10000.0, rms_norm_eps=1e-6)
    keys.update(HF_SMALL_CONFIGS[name], **overrides)
    config = Qwen3MoeConfig(**keys)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        # Larger-than-default weights so routing and attention are far from uniform; norms perturbed too.
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(std * torch.randn_like(param))
    return model
