"""The planner's LoRA memory model (plan/lora.py): adapter sizes counted exactly from the built models, the frozen
base without gradients or optimizer state, and predictions that move the right way."""

from dataclasses import replace

import pytest
import torch

from openrecipes.config.layout import LayoutConfig
from openrecipes.models.common.lora import LINEAR_TARGETS, LoraSpec, apply_lora
from openrecipes.models.common.moe import ExpertLowRank, swiglu_experts
from openrecipes.models.families import family_for_config
from openrecipes.models.registry import get_config
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.lora import LoraSetup, adapter_params
from openrecipes.plan.memory import (TrainingSetup, layer_activation_bytes, openrecipes_weight_gib, sharded_elements,
                                     stage_memory, stage_params)
from openrecipes.plan.shape import model_shape

GIB = 1024 ** 3
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("name,targets", [
    ("qwen3-moe-tiny", (*ATTENTION, "experts")),
    ("qwen3-moe-tiny", ("q_proj", "v_proj")),
    ("muse-spark-tiny", (*ATTENTION, "experts", "latent_down_proj", "latent_up_proj")),
    ("deepseek-v3-tiny", ("experts",)),  # its first layer is dense: no expert adapters there
])
def test_adapter_params_count_the_built_model(name, targets):
    config = get_config(name)
    model = family_for_config(config).build(config, device="cpu", dtype=torch.float32, seed=0)
    apply_lora(model, LoraSpec(rank=3, alpha=6.0, targets=targets))
    trained = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    shape = model_shape(config, name=name)
    dense, experts = adapter_params(shape, LayoutConfig(max_tokens_per_gpu=64), LoraSetup(rank=3, targets=targets),
                                    shape.num_layers)
    assert dense == sum(n for k, n in trained if ".experts." not in k)
    assert experts == sum(n for k, n in trained if ".experts." in k)
    # expert parallelism keeps E/ep experts' adapters; tensor parallelism splits one factor of each attention adapter
    ep2 = adapter_params(shape, LayoutConfig(max_tokens_per_gpu=64, ep=2, dp=2), LoraSetup(rank=3, targets=targets),
                         shape.num_layers)
    assert ep2 == (dense, experts / 2)
    # expert tensor parallelism splits gate/up's B and down's A by the FFN width, as a rank of the engine holds them
    etp2 = adapter_params(shape, LayoutConfig(max_tokens_per_gpu=64, etp=2, dp=2), LoraSetup(rank=3, targets=targets),
                          shape.num_layers)
    if "experts" in targets:
        assert etp2 == (dense, _etp_local_adapters(model, etp=2))
    tp2_dense, _ = adapter_params(shape, LayoutConfig(max_tokens_per_gpu=64, tp=2, sequence_parallel=True),
                                  LoraSetup(rank=3, targets=targets), shape.num_layers)
    assert dense / 2 < tp2_dense < dense or dense == tp2_dense == 0


def _etp_local_adapters(model, *, etp):
    """Expert adapter elements one etp rank holds: the factor split with the FFN width (``ffn_factor``) over etp."""
    from openrecipes.models.common.lora import ExpertAdapter

    adapters = [m for m in model.modules() if isinstance(m, ExpertAdapter)]
    return sum(p.numel() / (etp if name == a.ffn_factor else 1) for a in adapters
               for name, p in a.named_parameters(recurse=False))


def _stage(setup, **layout):
    shape = model_shape(replace(get_config("qwen3-30b-a3b"), num_hidden_layers=8))
    layout = LayoutConfig(max_tokens_per_gpu=4096, **layout)
    return shape, layout, stage_memory(shape, layout, [shape.num_layers], setup, load_hardware("H200"))[0]


@pytest.mark.parametrize("engine", ["openrecipes", "megatron"])
def test_frozen_base_has_no_gradients_or_optimizer_state(engine):
    lora = LoraSetup(rank=16, targets=(*ATTENTION, "experts"))
    _, _, full = _stage(TrainingSetup(recompute="full", engine=engine, global_batch_tokens=4096))
    shape, layout, adapted = _stage(TrainingSetup(recompute="full", engine=engine, global_batch_tokens=4096,
                                                  lora=lora))
    dense, experts = adapter_params(shape, layout, lora, shape.num_layers)
    # one process, one microbatch: bf16 gradients (2 B) and Adam's 12 B, of the adapters only; the base stays
    grad_bytes = 2 if engine == "openrecipes" else 4
    adapted_weights, full_weights = _resident(shape, layout, adapted, engine, lora), _resident(shape, layout, full,
                                                                                              engine, None)
    assert adapted_weights["optimizer"] == pytest.approx(12 * (dense + experts) / GIB, abs=1e-3)
    assert adapted_weights["grads"] == pytest.approx(grad_bytes * (dense + experts) / GIB, abs=1e-3)
    assert adapted_weights["params"] == pytest.approx(full_weights["params"] + 2 * (dense + experts) / GIB, abs=2e-3)
    assert adapted.allocated_gib < full.allocated_gib / 2


def _resident(shape, layout, stage, engine, lora) -> dict:
    """Parameters, gradients and optimizer state of the stage: this engine's parts are those alive at its peak
    moment (no gradient yet when the peak is the loss), so they are asked of the weights' model itself."""
    if engine != "openrecipes":
        return stage.parts_gib
    setup = TrainingSetup(recompute="full", engine=engine, global_batch_tokens=4096 * layout.dp, lora=lora)
    return openrecipes_weight_gib(shape, layout, setup, shape.num_layers, first=True, last=True)


def test_frozen_base_is_bf16_under_several_processes():
    # full training keeps fp32 masters (4 B) of every weight under several processes; LoRA keeps the frozen base in
    # bf16 (2 B) and fp32 adapter masters (4 B) with their gradients and moments; FSDP's gathered bf16 copies of the
    # adapters are below the parts' rounding. tests/distributed/test_bf16_layouts.py checks these bytes against
    # what the ranks of a run hold.
    lora = LoraSetup(rank=16, targets=(*ATTENTION, "experts"))
    common = dict(recompute="full", engine="openrecipes", global_batch_tokens=2 * 4096)
    _, _, full = _stage(TrainingSetup(**common), dp=2, ep=2)
    shape, layout, adapted = _stage(TrainingSetup(**common, lora=lora), dp=2, ep=2)
    base = sharded_elements(*stage_params(shape, layout, shape.num_layers, first=True, last=True), layout)
    adapters = sharded_elements(*adapter_params(shape, layout, lora, shape.num_layers), layout)
    adapted_weights = _resident(shape, layout, adapted, "openrecipes", lora)
    full_weights = _resident(shape, layout, full, "openrecipes", None)
    assert adapted_weights["params"] == pytest.approx(full_weights["params"] - 2 * base / GIB + 4 * adapters / GIB,
                                                      abs=2e-3)
    assert adapted_weights["grads"] == pytest.approx(4 * adapters / GIB, abs=1e-3)
    assert adapted_weights["optimizer"] == pytest.approx(8 * adapters / GIB, abs=1e-3)


def test_lora_predictions_move_the_right_way():
    shape = model_shape(get_config("qwen3-30b-a3b"))
    layout = LayoutConfig(max_tokens_per_gpu=8192, ep=8, dp=8)
    hw = load_hardware("H200")

    def peak(recompute, lora=None):
        setup = TrainingSetup(recompute=recompute, engine="openrecipes", global_batch_tokens=8 * 8192, lora=lora)
        return evaluate(shape, layout, setup, hw).stages[0]

    attention = LoraSetup(rank=16, targets=ATTENTION)
    experts = LoraSetup(rank=16, targets=(*ATTENTION, "experts"))
    wider = LoraSetup(rank=64, targets=(*ATTENTION, "experts"))
    for recompute in ("none", "full"):
        full, a, e, w = peak(recompute), peak(recompute, attention), peak(recompute, experts), peak(recompute, wider)
        assert a.allocated_gib < e.allocated_gib < w.allocated_gib < full.allocated_gib
        assert a.parts_gib["optimizer"] < e.parts_gib["optimizer"] < w.parts_gib["optimizer"]
    # frozen experts without adapters drop their routed inputs; expert adapters keep them
    none_full, none_attention, none_experts = peak("none"), peak("none", attention), peak("none", experts)
    assert none_attention.parts_gib["activations"] < none_full.parts_gib["activations"]
    assert none_experts.parts_gib["activations"] > none_full.parts_gib["activations"]


def test_lora_setup_errors():
    with pytest.raises(ValueError, match="lora.targets: unknown"):
        LoraSetup(rank=4, targets=("gate",))
    shape = model_shape(get_config("qwen3-moe-tiny"))
    with pytest.raises(ValueError, match="no latent projections"):
        adapter_params(shape, LayoutConfig(max_tokens_per_gpu=64), LoraSetup(rank=4, targets=LINEAR_TARGETS), 1)


def _saved_elements_per_copy(low_rank, dims):
    """Elements per routed copy that the experts save for the backward (distinct storages, parameters excluded)."""
    E, D, F, R = dims
    torch.manual_seed(0)
    frozen = [torch.randn(E, F, D), torch.randn(E, F, D), torch.randn(E, D, F)]
    params = {t.untyped_storage().data_ptr() for t in frozen + list(low_rank[:4] if low_rank else [])}
    x, weights = torch.randn(R, D, requires_grad=True), torch.rand(R, requires_grad=True)
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        swiglu_experts(x, torch.tensor([R // E] * E), *frozen, weights, backend="loop", low_rank=low_rank)
    return total / R


def test_expert_adapter_activations_are_what_the_engine_saves():
    """The planner's extra bytes per routed copy for expert adapters (over adapters on attention alone) equal what
    the engine's experts save in addition when they carry adapters."""
    E, D, F, R, r = 4, 64, 48, 40, 8
    adapters = ExpertLowRank(torch.randn(E, r, D, requires_grad=True), torch.randn(E, 2, F, r, requires_grad=True),
                             torch.randn(E, r, F, requires_grad=True), torch.randn(E, D, r, requires_grad=True), 2.0)
    measured = _saved_elements_per_copy(adapters, (E, D, F, R)) - _saved_elements_per_copy(None, (E, D, F, R))

    shape = replace(model_shape(get_config("qwen3-moe-tiny")), expert_in=D, expert_ffn=F)
    layout = LayoutConfig(max_tokens_per_gpu=256)
    copies = layout.max_tokens_per_gpu * shape.top_k * load_hardware("H200").memory.moe_token_imbalance
    def planned(targets):
        return layer_activation_bytes(shape, layout, "none", load_hardware("H200").memory.moe_token_imbalance,
                                      LoraSetup(rank=r, targets=targets))

    planned_bf16_bytes = (planned((*ATTENTION, "experts")) - planned(ATTENTION)) / copies
    assert planned_bf16_bytes / 2 == pytest.approx(measured) == D + F + 2 * r
