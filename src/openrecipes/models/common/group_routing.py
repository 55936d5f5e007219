"""Group-limited sigmoid routing with a correction bias, and the MoE block of routed plus shared experts around it:
DeepSeek-V3's and GLM-4.5's (transformers writes the same router for both, ``DeepseekV3TopkRouter`` and
``Glm4MoeTopkRouter``, under the same field names, so both families build these from their own configs).

Router: sigmoid scores in fp32; choice = scores + e_score_correction_bias; experts come from the topk_group groups
with the largest sum of their two best choices; the gating weights are the unbiased scores of the chosen experts,
renormalised (norm_topk_prob) and multiplied by routed_scaling_factor.

Legend: T tokens, D hidden, E routed experts, G groups, X experts per group, K experts per token.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.common.mlp import GatedMLP
from openrecipes.models.common.moe import GroupedExperts, LocalTokenDispatcher, Routing, balanced
from openrecipes.models.common.router import KeepFP32

# keeps a zero sum of gating weights finite, as transformers' router does
_NORM_FLOOR = 1e-20


class GroupRoutedConfig(Protocol):
    """The config fields (transformers' names) the router and the MoE block read."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    hidden_act: str


class GroupLimitedRouter(KeepFP32):
    """``forward(x_TD) -> Routing``; ``weight`` (E, D) fp32, ``e_score_correction_bias`` (E,) fp32 and frozen (it
    steers the choice only; a frozen parameter so checkpoints carry it like every other tensor)."""

    def __init__(self, config: GroupRoutedConfig, *, balanced_routing: bool = False) -> None:
        super().__init__()
        self.top_k, self.groups, self.top_groups = config.num_experts_per_tok, config.n_group, config.topk_group
        self.normalize_top_k, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.balanced_routing = balanced_routing
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        compute = torch.promote_types(self.weight.dtype, torch.float32)
        scores_TE = torch.sigmoid(F.linear(x_TD.to(compute), self.weight.to(compute)))
        choice_TE = scores_TE.detach() + self.e_score_correction_bias.detach().to(compute)
        tokens, experts = choice_TE.shape
        choice_TGX = choice_TE.view(tokens, self.groups, experts // self.groups)
        group_scores_TG = choice_TGX.topk(2, dim=-1).values.sum(dim=-1)
        best_groups_TG = torch.topk(group_scores_TG, self.top_groups, dim=-1).indices
        kept_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_groups_TG, True)
        choice_TE = choice_TGX.masked_fill(~kept_TG[..., None], float("-inf")).view(tokens, experts)
        experts_TK = torch.topk(choice_TE, self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(-1, experts_TK)
        if self.normalize_top_k:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + _NORM_FLOOR)
        weights_TK = weights_TK * self.scaling
        routing = Routing(experts_TK=experts_TK, weights_TK=weights_TK.to(x_TD.dtype))
        return balanced(routing, experts) if self.balanced_routing else routing


class GroupLimitedMoe(nn.Module):
    """Routed experts plus shared experts (one gated MLP ``n_shared_experts`` expert widths wide, which every token
    takes; plain ``nn.Linear``s so expert parallelism never takes them for routed experts). ``token_dispatcher`` is
    swapped by expert parallelism (not an nn.Module attribute), as in ``SparseMoeBlock``."""

    def __init__(self, config: GroupRoutedConfig, kernels: KernelOptions) -> None:
        super().__init__()
        self.gate = GroupLimitedRouter(config, balanced_routing=kernels.balanced_routing)
        self.experts = GroupedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                      activation=config.hidden_act, backend=kernels.experts)
        self.shared_experts = (GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                        config.hidden_act) if config.n_shared_experts else None)
        self.token_dispatcher = LocalTokenDispatcher()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        out = self.token_dispatcher(x_TD, self.gate(x_TD), self.experts).reshape(x_BTD.shape)
        return out if self.shared_experts is None else out + self.shared_experts(x_BTD)
