"""Step time, tokens/s/GPU and MFU of a layout (an estimate; efficiencies are data in planner.yaml).

Per microbatch and stage: matmul FLOPs (2 per multiply-add; forward + backward = 3 forwards, full
recompute adds one forward, selective adds the attention core again) at the dense or grouped-expert
efficiency; causal attention FLOPs with sliding windows; TP collectives, EP all-to-all and pipeline
sends over NVLink or the network depending on how far the group spans. A step is
``(m + pp/vpp - 1)`` times the slowest stage (1F1B bubble), plus the data-parallel gradient
reduce-scatter and parameter all-gather (not overlapped) and the optimizer step (GPU part memory-bound;
offloaded part at the CPU Adam rate, its PCIe copies overlapped with it; or, updated on the GPU, the time to stream
its state over PCIe, both directions at once). Under LoRA the frozen base computes no weight gradients (one
matmul pass less, the LM head's included) and only the adapters are synchronised and updated; the adapters' own
matmuls (rank r beside each adapted weight, three passes) are added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openrecipes.config.layout import LayoutConfig, expert_data_parallel_size
from openrecipes.measure.metrics import mfu as model_flops_utilisation
from openrecipes.plan.hardware import Hardware
from openrecipes.plan.lora import adapter_params
from openrecipes.config.recompute_names import WHOLE_LAYER_GRANULARITIES
from openrecipes.plan.memory import GRAD_BYTES, TrainingSetup, microbatches_per_step, recomputed_share, stage_params
from openrecipes.models.shape import mean_context
from openrecipes.plan.shape import ModelShape


@dataclass(kw_only=True)
class Throughput:
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    bubble_fraction: float
    microbatches: int
    parts_s: dict[str, float]
    # each stage's own figures (stage 0 first): compute of one microbatch (forward, backward and recompute, no
    # communication) and the optimizer step; what one rank measured alone compares with (train/rank_measure.py)
    stage_compute_s: list[float] = field(default_factory=list)
    stage_optimizer_s: list[float] = field(default_factory=list)


def _link_time(nbytes: float, span: int, hw: Hardware) -> float:
    """Seconds to move ``nbytes`` per GPU inside a group whose ranks span ``span`` consecutive GPUs."""
    if nbytes <= 0:
        return 0.0
    gpu, eff = hw.gpu, hw.efficiency.comm
    if span <= gpu.nvlink_domain:
        return nbytes / (gpu.nvlink_gb_s * 1e9 * eff)
    off_domain = 1.0 - gpu.nvlink_domain / span
    return max(nbytes * off_domain / (gpu.network_gb_s * 1e9 * eff),
               nbytes * (1 - off_domain) / (gpu.nvlink_gb_s * 1e9 * eff))


def _sync_and_update_s(shape: ModelShape, layout: LayoutConfig, counts: list[int], setup: TrainingSetup,
                       hw: Hardware, cpu_adam_rate: float) -> list[tuple[float, float]]:
    """The data-parallel gradient sync and the optimizer step of each stage, in seconds (not overlapped)."""
    eff = hw.efficiency
    edp = expert_data_parallel_size(layout)
    grad_bytes = GRAD_BYTES[setup.grad_dtype]
    dp_group = layout.dp * layout.cp
    stages = []
    for i, layers in enumerate(counts):
        dense, experts = stage_params(shape, layout, layers, first=i == 0, last=i == len(counts) - 1)
        if setup.lora is not None:  # only the adapters have gradients and optimizer state
            dense, experts = adapter_params(shape, layout, setup.lora, layers)
        s = 0.0
        if dp_group > 1:
            s += _link_time(dense * (grad_bytes + 2) * (dp_group - 1) / dp_group, layout.tp * dp_group, hw)
        if edp > 1:
            s += _link_time(experts * (grad_bytes + 2) * (edp - 1) / edp, layout.tp * layout.cp * layout.dp, hw)
        elements = dense / dp_group + experts / edp
        touched = (setup.state_bytes() + grad_bytes + 2) * 2  # read and write
        cpu_elems = elements * setup.offload_fraction
        if setup.offload_update == "device":
            gpu_opt = elements * touched / (hw.gpu.hbm_tb_s * 1e12 * eff.hbm)
            cpu_opt = cpu_elems * setup.state_bytes() / (hw.gpu.pcie_gb_s * 1e9)
        else:
            gpu_opt = elements * (1 - setup.offload_fraction) * touched / (hw.gpu.hbm_tb_s * 1e12 * eff.hbm)
            cpu_opt = max(cpu_elems / cpu_adam_rate,
                          cpu_elems * (grad_bytes + 2) / (hw.gpu.pcie_gb_s * 1e9))
        stages.append((s, gpu_opt + cpu_opt))
    return stages


def _mtp_layer_s(shape: ModelShape, tok: float, seq_len: float, imbalance: float, frozen: float, peak: float,
                 eff) -> float:
    """One MTP layer's compute per microbatch (its head: with the LM head's): a MoE layer with full attention and its
    2D -> D projection (norms left out), forward and two backward passes (never recomputed)."""
    dense = 2 * tok * (shape.attention_params + shape.latent_params + shape.router_params
                       + shape.shared_expert_params + 2 * shape.hidden ** 2)
    experts = 2 * tok * shape.top_k * shape.expert_params * imbalance
    attention = 4 * tok * shape.q_width * mean_context(seq_len, None)
    return ((3 - frozen) * (dense / eff.dense_matmul + experts / eff.expert_matmul) + 3 * attention / eff.attention
            ) / peak


def estimate_throughput(shape: ModelShape, layout: LayoutConfig, counts: list[int], setup: TrainingSetup,
                        hw: Hardware) -> Throughput:
    peak = hw.gpu.peak_bf16_dense_flops
    eff = hw.efficiency
    imbalance = hw.memory.moe_token_imbalance
    T = layout.max_tokens_per_gpu
    rows = layout.rows_per_microbatch or 1
    seq_len = T * layout.cp / rows  # upper bound: packed documents are no longer than a row
    tok = T / layout.tp  # tokens whose matmul work one rank does per microbatch
    passes = 4.0 if setup.recompute in WHOLE_LAYER_GRANULARITIES else 3.0
    # the attention kernel: once more with selective or attention_core, once less when full recompute keeps it
    attn_passes = passes + {"selective": 1.0, "attention_core": 1.0, "full_keep_attention": -1.0}.get(setup.recompute,
                                                                                                       0.0)
    expert_passes = passes + (1.0 if setup.recompute == "experts" else 0.0)
    comm_passes = passes - 1.0  # forward and backward move the same bytes; recompute repeats the forward

    dense_fwd = 2 * tok * shape.dense_layer_matmul_params()
    expert_fwd = 2 * tok * shape.moe_layer_fraction * shape.top_k * shape.expert_params * imbalance
    frozen = 0.0 if setup.lora is None else 1.0  # no weight-gradient pass for frozen weights
    adapter_fwd = 0.0
    if setup.lora is not None:  # per layer: the dense adapters on every token, the expert ones on every routed copy
        dense_adapters, expert_adapters = adapter_params(shape, layout, setup.lora, 1)
        adapter_fwd = 2 * tok * (dense_adapters + expert_adapters * shape.top_k / (shape.num_experts / layout.ep)
                                 * imbalance)
    tp_bytes = 2 * 2 * T * shape.hidden * 2 * (layout.tp - 1) / layout.tp if layout.tp > 1 else 0.0
    ep_bytes = 2 * tok * shape.top_k * shape.expert_in * 2 * (layout.ep - 1) / layout.ep * imbalance
    tp_time = _link_time(tp_bytes, layout.tp, hw)
    ep_time = _link_time(ep_bytes, layout.ep * layout.etp, hw)
    if layout.cp > 1:  # ring exchange of K and V over the CP group
        cp_bytes = 2 * T * shape.kv_width / layout.tp * 2 * (layout.cp - 1)
        tp_time += _link_time(cp_bytes, layout.tp * layout.cp, hw)

    calibration = hw.openrecipes_engine if setup.engine == "openrecipes" else None
    split_overhead = 0.0  # this engine's per-layer cost of splitting the sequence (host-bound; measured)
    if calibration is not None:
        split_overhead = (calibration.tp_s_per_layer * (layout.tp > 1) + calibration.cp_s_per_layer * (layout.cp > 1))
    cpu_adam_rate = calibration.cpu_adam_elements_per_s_per_rank if calibration else hw.cpu_adam_elements_per_s
    compute_scale = calibration.compute_scale(shape.family, hw.gpu.name) if calibration else 1.0  # measured/model

    stage_parts: list[dict[str, float]] = []
    for i, layers in enumerate(counts):
        lo = sum(counts[:i])
        attn_flops = sum(shape.attention_flops(j, tok, seq_len) for j in range(lo, lo + layers))
        # the block method: the first layers recompute, the others run three passes (forward, two backward)
        share = recomputed_share(setup, layers)
        mixed = lambda recomputing: share * recomputing + (1 - share) * 3.0  # noqa: E731
        compute = ((mixed(passes) - frozen) * layers * dense_fwd / (peak * eff.dense_matmul)
                   + (mixed(expert_passes) - frozen) * layers * expert_fwd / (peak * eff.expert_matmul)
                   + mixed(passes) * layers * adapter_fwd / (peak * eff.dense_matmul)
                   + mixed(attn_passes) * attn_flops / (peak * eff.attention))
        if i == len(counts) - 1:
            head_passes = (4 if setup.loss_chunk_tokens else 3) - frozen  # the chunked loss computes the logits again
            compute += (1 + shape.mtp_layers) * head_passes * 2 * tok * shape.lm_head_params / (peak * eff.dense_matmul)
            compute += shape.mtp_layers * _mtp_layer_s(shape, tok, seq_len, imbalance, frozen, peak, eff)
        p2p = 0.0
        if layout.pp > 1:
            hidden_tokens = T / layout.tp if layout.sequence_parallel else T
            p2p = 2 * _link_time(2 * shape.hidden * hidden_tokens, 2 * layout.tp * layout.cp * layout.dp, hw)
        layer_comm = (share * comm_passes + (1 - share) * 2.0) * layers
        stage_parts.append({"compute": compute * compute_scale,
                            "tp_cp": layer_comm * tp_time + layers * split_overhead,
                            "ep": layer_comm * ep_time, "pp": p2p})
    stage_times = [sum(p.values()) for p in stage_parts]
    parts = stage_parts[stage_times.index(max(stage_times))]  # per microbatch, on the slowest stage

    m = microbatches_per_step(layout, setup)
    slots = m + (layout.pp - 1) / layout.vpp
    pipeline = slots * max(stage_times)
    bubble = (slots - m) / slots

    per_stage = _sync_and_update_s(shape, layout, counts, setup, hw, cpu_adam_rate)
    sync, opt = max(s for s, _ in per_stage), max(o for _, o in per_stage)
    step = pipeline + sync + opt
    tokens = m * layout.dp * layout.cp * T
    world = layout.world_size
    tps = tokens / step / world
    mfu = model_flops_utilisation(shape.active_params, tps, peak)
    parts_s = {k: v for k, v in parts.items()}
    parts_s.update(pipeline=pipeline, dp_sync=sync, optimizer=opt)
    return Throughput(step_time_s=step, tokens_per_s_per_gpu=tps, mfu=mfu, bubble_fraction=bubble,
                      microbatches=m, parts_s={k: round(v, 4) for k, v in parts_s.items()},
                      stage_compute_s=[p["compute"] for p in stage_parts], stage_optimizer_s=[o for _, o in per_stage])
