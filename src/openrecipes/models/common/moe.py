"""Mixture of experts: a softmax top-k router and gated experts (SwiGLU by default) held as grouped 3-D weights.

Legend: T tokens, D hidden, E experts, F expert FFN width, K experts per token, R = T·K routed token copies.

Tokens are sorted by expert so each expert sees one contiguous slice; the expert matmuls then run as one
``torch._grouped_mm`` per projection on CUDA in bf16, or as an exact per-expert loop elsewhere. Expert parallelism
replaces ``LocalTokenDispatcher`` (from ``openrecipes.parallel``) without touching this file's math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.config.kernel_names import backend_runs
from openrecipes.models.common.activations import ACTIVATIONS, check_activation
from openrecipes.models.common.fp8 import FP8_EXPERTS, fp8_grouped_linear
from openrecipes.models.common.kernels import KernelOptions


@dataclass(frozen=True)
class Routing:
    """The router's decision: for each token its K experts and their gating weights."""

    experts_TK: torch.Tensor  # int64
    weights_TK: torch.Tensor  # activation dtype


def balanced(routing: Routing, num_experts: int) -> Routing:
    """The same gating weights with the experts chosen round-robin: every expert gets the same load."""
    tokens, top_k = routing.experts_TK.shape
    experts = torch.arange(tokens * top_k, device=routing.experts_TK.device) % num_experts
    return Routing(experts_TK=experts.view(tokens, top_k), weights_TK=routing.weights_TK)


class SoftmaxTopKRouter(nn.Module):
    """Softmax over all experts in fp32, keep the top K, optionally renormalise them to sum to one."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, normalize_top_k: bool,
                 balanced_routing: bool = False) -> None:
        super().__init__()
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.balanced_routing = balanced_routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # set by router_loss.RouterStatistics for the duration of one forward: it sums the routing for the
        # load-balancing loss (a plain attribute, not a module or state)
        self.statistics = None

    def forward(self, x_TD: torch.Tensor) -> Routing:
        logits_TE = F.linear(x_TD, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_TK, experts_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.statistics is not None:
            self.statistics.record(probs_TE, experts_TK)
        if self.normalize_top_k:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        routing = Routing(experts_TK=experts_TK, weights_TK=weights_TK.to(x_TD.dtype))
        return balanced(routing, self.weight.shape[0]) if self.balanced_routing else routing


def use_grouped_mm(x: torch.Tensor, backend: str = "auto") -> bool:
    """``auto``: grouped_mm for bf16 on CUDA, else the loop; ``loop`` forces the per-expert fallback (``fp8``, set
    by the recipe's fp8 section, has its own products: common/fp8.py)."""
    if backend in ("loop", FP8_EXPERTS):
        return False
    supported = (backend_runs("experts", "grouped_mm", cuda=x.is_cuda, bf16=x.dtype == torch.bfloat16)
                 and hasattr(torch, "_grouped_mm"))
    if backend == "grouped_mm" and not supported:
        raise ValueError(f"expert backend 'grouped_mm' needs bf16 tensors on CUDA, got {x.dtype} on {x.device}")
    return supported


def grouped_linear(x_RI: torch.Tensor, weight_EOI: torch.Tensor, counts_E: torch.Tensor,
                   offsets_E: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """y[r] = weight[e(r)] @ x[r] for rows sorted by expert; ``counts_E`` rows belong to expert e in order."""
    if backend == FP8_EXPERTS:
        return fp8_grouped_linear(x_RI, weight_EOI, counts_E, offsets_E)
    if use_grouped_mm(x_RI, backend):
        if offsets_E is None:
            offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x_RI, weight_EOI.transpose(-2, -1), offs=offsets_E)
    pieces = torch.split(x_RI, counts_E.tolist())
    return torch.cat([F.linear(piece, weight_EOI[e]) for e, piece in enumerate(pieces)], dim=0)


class ExpertLowRank(NamedTuple):
    """Per-expert rank-r updates added beside the grouped weights: row x of expert e gets s · B_e A_e x on top of
    W_e x, each factor as its adapter holds it (``common.lora``). The gate and up projections share A, as in
    transformers' fused gate_up_proj: ``gate_up_A`` (E, r, D), ``gate_up_B`` (E, 2, F, r), gate then up; the down
    projection has ``down_A`` (E, r, F) and ``down_B`` (E, D, r)."""

    gate_up_A: torch.Tensor
    gate_up_B: torch.Tensor
    down_A: torch.Tensor
    down_B: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated form: the gate clamped above at ``limit``, the up projection clamped to [-limit, limit], and
    (up + 1) · gate · sigmoid(alpha · gate). A gated form of its own rather than an activation: the clamp and the
    ``+ 1`` act on both projections (transformers' ``GptOssExperts._apply_gate``)."""

    alpha: float
    limit: float

    def __call__(self, gate_RF: torch.Tensor, up_RF: torch.Tensor) -> torch.Tensor:
        gate_RF = gate_RF.clamp(max=self.limit)
        up_RF = up_RF.clamp(min=-self.limit, max=self.limit)
        return (up_RF + 1) * (gate_RF * torch.sigmoid(gate_RF * self.alpha))


class ExpertBiases(NamedTuple):
    """Per-expert biases of the three projections: gate and up (E, F), down (E, D)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class GroupedExperts(nn.Module):
    """E gated experts, act(x W_gate) * (x W_up) W_down (SwiGLU with ``silu``); weights stored (E, out, in) like
    nn.Linear, one tensor per projection. ``activation`` is a name from ``common.activations`` (HF ``hidden_act``).
    ``bias``: per-expert biases ``{gate,up,down}_proj_bias`` beside the weights; ``glu``: a gated form replacing
    act(gate) · up (gpt-oss's ``ClampedSwiGLU``). Both default off, leaving the plain experts unchanged.

    ``lora_gate_up`` and ``lora_down`` hold per-expert adapters (modules with ``lora_A``, ``lora_B`` and ``scaling``)
    once ``common.lora`` adds them; every adapted instance stays this one class, so a compiled block serves them all."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, *, activation: str = "silu",
                 backend: str = "auto", bias: bool = False, glu: ClampedSwiGLU | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = check_activation(activation)
        self.backend = backend  # KernelOptions.experts
        self.glu = glu
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        if bias:
            self.gate_proj_bias = nn.Parameter(torch.empty(num_experts, ffn_size))
            self.up_proj_bias = nn.Parameter(torch.empty(num_experts, ffn_size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.has_bias = bias
        self.lora_gate_up: nn.Module | None = None
        self.lora_down: nn.Module | None = None

    def biases(self) -> ExpertBiases | None:
        return ExpertBiases(self.gate_proj_bias, self.up_proj_bias, self.down_proj_bias) if self.has_bias else None

    def low_rank(self, local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> ExpertLowRank | None:
        """The adapters' factors (each through ``local``: an expert-parallel rank's own shard), None without."""
        if self.lora_gate_up is None:
            return None
        gate_up, down = self.lora_gate_up, self.lora_down
        return ExpertLowRank(local(gate_up.lora_A), local(gate_up.lora_B), local(down.lora_A), local(down.lora_B),
                             gate_up.scaling)

    def forward(self, x_RD: torch.Tensor, counts_E: torch.Tensor, weights_R: torch.Tensor | None = None) -> torch.Tensor:
        """``x_RD`` sorted by expert, ``counts_E`` rows per local expert; ``weights_R`` (optional) scales each
        row's hidden activation. Returns (R, D)."""
        return swiglu_experts(x_RD, counts_E, self.gate_proj, self.up_proj, self.down_proj, weights_R,
                              activation=self.activation, backend=self.backend, low_rank=self.low_rank(),
                              biases=self.biases(), glu=self.glu)


def _low_rank_linear(x_RI: torch.Tensor, A_ErI: torch.Tensor, B_EOr: torch.Tensor, scaling: float,
                     counts_E: torch.Tensor, offsets_E: torch.Tensor | None, backend: str) -> torch.Tensor:
    """s · B_e A_e x for rows sorted by expert, in the rows' dtype (fp32 adapters on a bf16 base compute as bf16)."""
    A_ErI, B_EOr = A_ErI.to(x_RI.dtype), B_EOr.to(x_RI.dtype)
    pad = -A_ErI.shape[1] % (16 // x_RI.element_size())
    if pad and use_grouped_mm(x_RI, backend):  # grouped_mm needs 16-byte strides: zero ranks up to that, exactly
        A_ErI, B_EOr = F.pad(A_ErI, (0, 0, 0, pad)), F.pad(B_EOr, (0, pad))
    low_Rr = grouped_linear(x_RI, A_ErI, counts_E, offsets_E, backend) * scaling
    return grouped_linear(low_Rr, B_EOr, counts_E, offsets_E, backend)


def swiglu_experts(x_RD: torch.Tensor, counts_E: torch.Tensor, gate_EFD: torch.Tensor, up_EFD: torch.Tensor,
                   down_EDF: torch.Tensor, weights_R: torch.Tensor | None = None, *,
                   activation: str = "silu", backend: str = "auto",
                   low_rank: ExpertLowRank | None = None, biases: ExpertBiases | None = None,
                   glu: ClampedSwiGLU | None = None) -> torch.Tensor:
    """The gated experts on rows sorted by expert; ``activation`` (a ``common.activations`` name) gates the up
    projection: SwiGLU for ``silu``, GeGLU for ``gelu``. ``low_rank``: adapters' updates added to each projection.
    ``biases``: each row's expert's biases added after each projection; ``glu``: a gated form in place of
    act(gate) · up.

    An adapted projection computes x W^T + s (x A^T) B^T, not x (W + s B A)^T: the same value up to rounding (within
    1e-5 of PEFT's merged weights in fp32), in bf16 the update is not rounded away into W's precision, and it
    costs R·r·(I + O) multiply-adds instead of E·O·I·r with an (E, O, I) merged weight written and kept for the
    backward per step. The frozen W is read as it is; autograd reaches only A, B and the activations."""
    grouped = use_grouped_mm(x_RD, backend) or backend == FP8_EXPERTS
    offsets = torch.cumsum(counts_E, dim=0, dtype=torch.int32) if grouped else None
    gate_RF = grouped_linear(x_RD, gate_EFD, counts_E, offsets, backend)
    up_RF = grouped_linear(x_RD, up_EFD, counts_E, offsets, backend)
    if low_rank is not None:  # one A for both: gate's and up's updates from one (R, r) product
        B_E2Fr = low_rank.gate_up_B
        gate_up_R2F = _low_rank_linear(x_RD, low_rank.gate_up_A, B_E2Fr.flatten(1, 2), low_rank.scaling, counts_E,
                                       offsets, backend)
        gate_RF = gate_RF + gate_up_R2F[:, :B_E2Fr.shape[2]]
        up_RF = up_RF + gate_up_R2F[:, B_E2Fr.shape[2]:]
    if biases is not None:
        # each row's expert, without a host sync (output_size given)
        experts_R = torch.repeat_interleave(torch.arange(counts_E.shape[0], device=counts_E.device), counts_E,
                                            output_size=x_RD.shape[0])
        gate_RF = gate_RF + biases.gate.to(gate_RF.dtype)[experts_R]
        up_RF = up_RF + biases.up.to(up_RF.dtype)[experts_R]
    hidden_RF = glu(gate_RF, up_RF) if glu is not None else ACTIVATIONS[activation](gate_RF) * up_RF
    if weights_R is not None:
        # the down projection is linear, so gating its F-wide input equals gating its D-wide output, for less work
        hidden_RF = hidden_RF * weights_R.unsqueeze(-1)
    out_RD = grouped_linear(hidden_RF, down_EDF, counts_E, offsets, backend)
    if low_rank is not None:
        out_RD = out_RD + _low_rank_linear(hidden_RF, low_rank.down_A, low_rank.down_B, low_rank.scaling, counts_E,
                                           offsets, backend)
    if biases is not None:  # the down bias is gated like the product it follows
        down_RD = biases.down.to(out_RD.dtype)[experts_R]
        out_RD = out_RD + (down_RD if weights_R is None else down_RD * weights_R.unsqueeze(-1))
    return out_RD


class GatherTokenCopies(torch.autograd.Function):
    """x_TD -> x_RD: the K copies of every token, sorted by expert. The backward gathers each copy's gradient
    back by the inverse permutation and sums the K copies: no scatter, no atomics."""

    @staticmethod
    def forward(ctx, x_TD, order_R, inverse_R, top_k):
        ctx.save_for_backward(inverse_R)
        ctx.top_k = top_k
        return x_TD.index_select(0, torch.div(order_R, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_RD):
        (inverse_R,) = ctx.saved_tensors
        grad_TKD = grad_RD.index_select(0, inverse_R).view(-1, ctx.top_k, grad_RD.shape[-1])
        return grad_TKD.sum(dim=1), None, None, None


class PermuteRows(torch.autograd.Function):
    """y[i] = x[index[i]] for a permutation ``index``; the backward is the gather by its inverse."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def sort_by_expert(experts_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order_R, inverse_R, counts_E): token copies sorted by expert, the inverse permutation, copies per expert."""
    flat_experts_R = experts_TK.flatten()
    order_R = torch.argsort(flat_experts_R, stable=True)
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    # not bincount: on CUDA it reads the largest id back to size its output, a host sync in every MoE layer
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat_experts_R.device).scatter_add_(
        0, flat_experts_R, torch.ones_like(flat_experts_R))
    return order_R, inverse_R, counts_E


class LocalTokenDispatcher:
    """All experts on this process: sort token copies by expert, run them (gated by their routing weights), unsort
    and sum the K copies of each token."""

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        tokens, top_k = routing.experts_TK.shape
        order_R, inverse_R, counts_E = sort_by_expert(routing.experts_TK, experts.num_experts)
        weights_R = routing.weights_TK.flatten()[order_R]
        out_RD = experts(GatherTokenCopies.apply(x_TD, order_R, inverse_R, top_k), counts_E, weights_R)
        return PermuteRows.apply(out_RD, inverse_R, order_R).view(tokens, top_k, -1).sum(dim=1)


class SparseMoeBlock(nn.Module):
    """Router + experts. ``token_dispatcher`` is swapped by expert parallelism (not an nn.Module attribute)."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, ffn_size: int,
                 normalize_top_k: bool, activation: str = "silu", kernels: KernelOptions = KernelOptions()) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(hidden_size, num_experts, top_k, normalize_top_k=normalize_top_k,
                                      balanced_routing=kernels.balanced_routing)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_size, activation=activation,
                                      backend=kernels.experts)
        self.token_dispatcher = LocalTokenDispatcher()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        routing = self.gate(x_TD)
        return self.token_dispatcher(x_TD, routing, self.experts).reshape(x_BTD.shape)
