"""What LoRA changes in the planner's memory model (plan/memory.py; models/common/lora.py is the engine's side).

The base is frozen: its parameters stay, in bf16 (this engine keeps no fp32 masters of it under several processes
either), but it has no gradients and no optimizer state. The adapters train: parameters, gradients and optimizer state
as any trained weight. Activations: frozen experts without adapters need not keep the routed expert inputs (those
serve only the experts' weight gradients); expert adapters keep them. Every linear adapter keeps its rank-r product
A·x for B's gradient. This engine adds the expert adapters beside the grouped GEMMs (x W^T + s·(x A^T) B^T,
models/common/moe.py): no merged weight exists; each routed copy keeps for the adapters' gradients what frozen
experts without adapters drop, the expert input (gate/up's A) and the gated hidden (down's A), and the two rank-r
products x A^T and h A^T (B's), all bf16.

Adapter sizes per rank follow the engine's split (parallel/tensor.py): a column-parallel projection's B and a
row-parallel projection's A split by TP, the other factor whole; latent projections whole; expert adapters with
their experts (E/ep of them), and by etp as their weights (gate/up's B and down's A; parallel/expert.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from openrecipes.config.layout import LayoutConfig
from openrecipes.models.common.lora import EXPERTS, TARGETS
from openrecipes.plan.shape import ModelShape


@dataclass(kw_only=True, frozen=True)
class LoraSetup:
    rank: int
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank: must be positive, got {self.rank}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"lora.targets: unknown target(s) {unknown}; choose among {', '.join(TARGETS)}")

    @property
    def experts(self) -> bool:
        return EXPERTS in self.targets


def _linear_adapters(shape: ModelShape, layout: LayoutConfig) -> dict[str, tuple[float, float]]:
    """Per target: (A, B) elements per rank over r, for one layer."""
    H, q, kv, tp = shape.hidden, shape.q_width, shape.kv_width, layout.tp
    return {"q_proj": (H, q / tp), "k_proj": (H, kv / tp), "v_proj": (H, kv / tp), "o_proj": (q / tp, H),
            "latent_down_proj": (H, shape.latent), "latent_up_proj": (shape.latent, H)}


def adapter_params(shape: ModelShape, layout: LayoutConfig, lora: LoraSetup, layers: int) -> tuple[float, float]:
    """(dense, expert) adapter parameters one rank of a stage of ``layers`` layers holds."""
    linear = _linear_adapters(shape, layout)
    if shape.latent == 0 and any(t.startswith("latent_") for t in lora.targets):
        raise ValueError(f"lora.targets: {shape.name or 'the model'} has no latent projections to adapt")
    dense = layers * lora.rank * sum(sum(linear[t]) for t in lora.targets if t in linear)
    experts = 0.0
    if lora.experts:  # gate_up: A (r, in) + B (2F/etp, r); down: A (r, F/etp) + B (in, r), split like the FFN
        per_expert = lora.rank * (2 * shape.expert_in + 3 * shape.expert_ffn / layout.etp)
        experts = layers * shape.moe_layer_fraction * shape.num_experts / layout.ep * per_expert  # dense layers: none
    return dense, experts


def rank_product_bytes_per_token(shape: ModelShape, layout: LayoutConfig, lora: LoraSetup) -> float:
    """Bytes per token and layer of the linear adapters' A·x (bf16, r wide), kept for B's gradient."""
    return 2.0 * lora.rank * sum(1 for t in lora.targets if t in _linear_adapters(shape, layout))


def expert_adapter_bytes_per_copy(shape: ModelShape, layout: LayoutConfig, lora: LoraSetup) -> float:
    """Bytes per routed token copy and layer that expert adapters keep beyond frozen experts without adapters, less
    the expert input (``layer_activation_bytes`` counts it as any trained expert's): the gated hidden (down's A
    reads it) and the two rank-r products (bf16); zero without expert adapters."""
    if not lora.experts:
        return 0.0
    return 2.0 * shape.expert_ffn / layout.etp + 2.0 * 2 * lora.rank
