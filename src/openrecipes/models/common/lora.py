"""LoRA adapters applied to a built model from outside, pure PyTorch (no model forward is replaced).

Legend: E experts, D hidden (in), O out, F expert FFN width, r rank; scaling s = alpha / r.

- A linear target (attention ``q_proj``/``k_proj``/``v_proj``/``o_proj``, Muse Spark's ``latent_down_proj``/
  ``latent_up_proj``, Qwen3.5-MoE's linear-attention ``in_proj_qkv``/``in_proj_z``/``in_proj_a``/``in_proj_b``/
  ``out_proj``) gets two child modules, ``lora_A`` (D -> r) and ``lora_B`` (r -> O), and a forward hook that adds
  ``s · lora_B(lora_A(dropout(x)))`` to its output. The base weight keeps its name (``...q_proj.weight``) and the
  adapter's names are PEFT's (``...q_proj.lora_A.weight``), so the Hugging Face export is a prefix.
- The routed experts (``experts``) get one adapter per expert, held by the grouped experts module itself
  (``GroupedExperts.lora_gate_up`` / ``lora_down``), which adds s · B_e A_e x beside W_e x in its forward
  (``moe.swiglu_experts``, which says why the update is not merged into W). No weight is reparametrized: every adapted
  experts module stays one class, so one compiled MoE block serves every layer, and the base weights keep their names
  (``...experts.gate_proj``). As in transformers' fused layout (and so in PEFT's ``target_parameters``), the
  gate and up projections share one adapter of the fused (E, 2F, D) ``gate_up_proj``: ``lora_gate_up`` holds
  A (E, r, D) and B (E, 2, F, r), gate then up (B's 2F rows in two halves: the FFN width F is a dimension of its own,
  which expert tensor parallelism shards); ``lora_down`` holds A (E, r, F) and B (E, D, r). PEFT defines these
  adapters as a weight delta, where dropout of the input has no place (it refuses it), so expert targets need
  ``dropout: 0``.

Everything but the adapters is frozen (``requires_grad`` False: no gradients, no optimizer state). A (and per expert
each A_e) starts as PEFT's default, Kaiming-uniform with a = sqrt(5), each tensor drawn whole on the CPU from a
generator seeded by (``seed``, its parameter name) (``common.init.seeded_uniform``): every rank, and a pipeline stage
holding only some layers, draws what one process does. B starts at zero, so the adapted model starts as the base.

The layouts (``openrecipes.parallel``) adapt the model after materialising their shard of it: expert parallelism
slices the expert adapters with their experts, tensor parallelism splits each projection's adapter with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.functional import linear

from openrecipes.models.common.init import seeded_uniform
from openrecipes.models.common.moe import GroupedExperts

LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "latent_down_proj", "latent_up_proj",
                  "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
EXPERTS = "experts"
TARGETS = (*LINEAR_TARGETS, EXPERTS)


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_recipe(cls, recipe: Any) -> LoraSpec:
        """The recipe's ``lora`` section as the model-side spec (adapters drawn from the recipe's seed)."""
        lora = recipe.lora
        return cls(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.targets),
                   seed=recipe.seed)


@torch.no_grad()
def _kaiming_(tensor: torch.Tensor, name: str, fan_in: int, seed: int) -> None:
    """nn.init.kaiming_uniform_(a=sqrt(5)) (nn.Linear's and PEFT's default for A), seeded by (seed, name)."""
    tensor.copy_(seeded_uniform(tensor.shape, name, seed=seed, bound=1.0 / math.sqrt(fan_in),
                                device=torch.device("cpu")))


def _linear_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    x = module.lora_dropout(inputs[0])
    # in the input's dtype: fp32 adapters on a bf16 base compute as bf16 ones do (their gradients come back fp32)
    low_rank = linear(x, module.lora_A.weight.to(x.dtype))
    return output + linear(low_rank, module.lora_B.weight.to(x.dtype)) * module.lora_scaling


class ExpertAdapter(nn.Module):
    """One rank-r adapter per expert of ``parts`` grouped (E, O, D) weights that share A: delta_e = s · B_e A_e.

    B is (E, O, r) for one weight, (E, parts, O, r) for several (the fused gate_up). ``ffn_factor`` names the factor
    holding the expert FFN width F, always in its dimension 2: B of a column-parallel weight (gate and up, O = F),
    A of a row-parallel one (down, D = F). Expert tensor parallelism shards that factor there and keeps the other
    whole, as the weight itself is split (parallel/expert.py)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, rank: int, scaling: float, *,
                 parts: int | None, ffn_factor: str, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        b_shape = (num_experts, out_features, rank) if parts is None else (num_experts, parts, out_features, rank)
        self.lora_A = nn.Parameter(torch.empty(num_experts, rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, device=device, dtype=dtype))
        self.scaling = scaling
        self.ffn_factor = ffn_factor

    def delta(self, part: int | None) -> torch.Tensor:
        """s · B A in fp32 for the weight ``part`` (None: the only one): what merging adds to it."""
        B = self.lora_B.float()
        return torch.bmm(B if part is None else B[:, part], self.lora_A.float()) * self.scaling


def _adapt_linear(linear: nn.Linear, name: str, spec: LoraSpec, dtype: torch.dtype | None) -> None:
    like = dict(device=linear.weight.device, dtype=dtype or linear.weight.dtype)
    linear.lora_A = nn.Linear(linear.in_features, spec.rank, bias=False, **like)
    linear.lora_B = nn.Linear(spec.rank, linear.out_features, bias=False, **like)
    _kaiming_(linear.lora_A.weight, f"{name}.lora_A.weight", linear.in_features, spec.seed)
    with torch.no_grad():
        linear.lora_B.weight.zero_()
    linear.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
    linear.lora_scaling = spec.scaling
    linear.register_forward_hook(_linear_hook)


def _adapt_experts(experts: GroupedExperts, name: str, spec: LoraSpec, dtype: torch.dtype | None) -> None:
    # the whole (E, F, D) shape: an expert-parallel base reports it too, and the layout then keeps its experts' slice
    E, F, D = experts.gate_proj.shape
    like = dict(device=experts.gate_proj.device, dtype=dtype or experts.gate_proj.dtype)
    experts.lora_gate_up = ExpertAdapter(E, F, D, spec.rank, spec.scaling, parts=2, ffn_factor="lora_B", **like)
    experts.lora_down = ExpertAdapter(E, D, F, spec.rank, spec.scaling, parts=None, ffn_factor="lora_A", **like)
    _kaiming_(experts.lora_gate_up.lora_A, f"{name}.lora_gate_up.lora_A", D, spec.seed)
    _kaiming_(experts.lora_down.lora_A, f"{name}.lora_down.lora_A", F, spec.seed)


def apply_lora(model: nn.Module, spec: LoraSpec, *, dtype: torch.dtype | None = None) -> list[str]:
    """Add adapters to every target of ``model`` (in place), freeze the rest; return the adapted module names.

    ``dtype``: the adapters' parameters' (None: their base weight's); a bf16 base may train fp32 adapters, which then
    compute in the dtype they meet (the input of a linear target, the weight of the experts). A target no module of
    the model has is an error naming it (Qwen3-MoE has no latent projections)."""
    unknown = sorted(set(spec.targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"lora.targets: unknown target(s) {unknown}; choose among {', '.join(TARGETS)}")
    if EXPERTS in spec.targets and spec.dropout:
        raise ValueError("lora.dropout must be 0 with the experts target: the expert adapters are PEFT's deltas "
                         "of the grouped weights, where dropout of the input is not defined")
    for param in model.parameters():
        param.requires_grad_(False)
    adapted: list[str] = []
    found: set[str] = set()
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in spec.targets and isinstance(module, nn.Linear):
            _adapt_linear(module, name, spec, dtype)
        elif EXPERTS in spec.targets and isinstance(module, GroupedExperts):
            _adapt_experts(module, name, spec, dtype)
            leaf = EXPERTS
        else:
            continue
        found.add(leaf)
        adapted.append(name)
    missing = sorted(set(spec.targets) - found)
    if missing:
        raise ValueError(f"lora.targets: the model has no {', '.join(missing)} to adapt")
    return adapted


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name (``...q_proj.lora_A.weight``, ``...experts.lora_gate_up.lora_A``)."""
    return {name: param.detach() for name, param in model.named_parameters() if "lora_" in name}


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight and remove it, in place: each linear target's weight becomes
    W + s · B A and each expert weight W_e + s · B_e A_e (summed in fp32, stored in W's dtype), and the model is left
    with the base model's parameters (an export of a LoRA run is the merged model)."""
    for module in list(model.modules()):
        if isinstance(module, GroupedExperts) and module.lora_gate_up is not None:
            for weight, adapter, part in (("gate_proj", module.lora_gate_up, 0), ("up_proj", module.lora_gate_up, 1),
                                          ("down_proj", module.lora_down, None)):
                base = getattr(module, weight)
                base.copy_((base.float() + adapter.delta(part)).to(base.dtype))
            module.lora_gate_up = module.lora_down = None
        elif isinstance(module, nn.Linear) and hasattr(module, "lora_A"):
            delta = module.lora_B.weight.float() @ module.lora_A.weight.float() * module.lora_scaling
            module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
            for key in [k for k, hook in module._forward_hooks.items() if hook is _linear_hook]:
                del module._forward_hooks[key]
            del module.lora_A, module.lora_B, module.lora_dropout, module.lora_scaling
