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
    _perturb(model, std)
    return model


# transformers' own tester configuration for Qwen3-MoE: the values Qwen3MoeModelTester (CausalLMModelTester's
# defaults, tests/causal_lm_tester.py) passes to Qwen3MoeConfig — hidden_act gelu, pad token 0, and no
# norm_topk_prob, so transformers' default false — and the shape of its input ids (batch 13, 7 tokens).
TESTER_CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     intermediate_size=37, hidden_act="gelu", max_position_embeddings=512, initializer_range=0.02,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, moe_intermediate_size=12, num_experts_per_tok=2,
                     num_experts=8)
TESTER_INPUT_SHAPE = (13, 7)

# each variant changes a few keys of TESTER_CONFIG
TESTER_VARIANTS = {
    "tester": {},
    "silu": dict(hidden_act="silu"),
    "gelu_pytorch_tanh": dict(hidden_act="gelu_pytorch_tanh"),
    "head_dim_24": dict(head_dim=24),  # 2 heads x 24 != hidden 32
    "gqa_4to1": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    "attention_bias": dict(attention_bias=True),
    "top1": dict(num_experts_per_tok=1),
    "top1_normalized": dict(num_experts_per_tok=1, norm_topk_prob=True),  # weight 1: the router gets no gradient
    "top_all": dict(num_experts_per_tok=8),
    "top_all_normalized": dict(num_experts_per_tok=8, norm_topk_prob=True),
    "normalized_top2": dict(norm_topk_prob=True),
    "rope_theta_500": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "rms_norm_eps_1e-2": dict(rms_norm_eps=1e-2),
    "no_pad_token": dict(pad_token_id=None),
    # dense layers: a gated MLP of intermediate_size where transformers builds one
    "mlp_only_layer_0": dict(mlp_only_layers=[0]),
    "decoder_sparse_step_2": dict(decoder_sparse_step=2),  # layer 0 dense, layer 1 MoE
    "all_dense": dict(mlp_only_layers=[0, 1]),
    # every layer attends to the last 3 tokens (the input has 7); a window without use_sliding_window is dropped
    "sliding_window_3": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "sliding_window_off": dict(use_sliding_window=False, sliding_window=3),
    "window_and_dense": dict(use_sliding_window=True, sliding_window=2, decoder_sparse_step=2),
}


def make_tester_model(variant: str, seed: int = 0, std: float = 0.08):
    """transformers' Qwen3MoeForCausalLM for TESTER_CONFIG with TESTER_VARIANTS[variant], weights perturbed as in
    ``make_hf_model`` (the tester's 0.02 init routes almost uniformly)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**TESTER_CONFIG, **TESTER_VARIANTS[variant]})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float().eval()
    _perturb(model, std)
    return model


def _perturb(model, std: float) -> None:
    """Larger-than-default weights so routing and attention are far from uniform; norms perturbed too."""
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(std * torch.randn_like(param))
