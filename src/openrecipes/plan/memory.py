"""Peak GPU memory per rank of each pipeline stage.

Model (all sizes per rank; docs/plan.md gives the derivation):
- weights: attention matmuls split by TP; router, norms, residual gates and latent projections replicated; experts split by EP
  (and ETP); the embedding on the first stage, the LM head on the last (split by TP in Megatron, whole on every TP
  rank in this engine). This engine shards with FSDP2 over dp only: with dp = 1 every rank keeps its split whole.
- bf16 params (2 B) and gradients (fp32 4 B or bf16 2 B) whole on every rank (distributed optimizer,
  ZeRO-1 style); optimizer state sharded over the data-parallel group (dense: dp*cp ranks) and the
  expert-data-parallel group (experts: edp ranks). State bytes per parameter: adam 12 (fp32 master and
  two fp32 moments), precision-aware 6 (int16 remainder and two bf16 moments). bf16 gradients add an
  fp32 shard (4 B, sharded) built at the optimizer step. ``offload_fraction`` moves that share of the
  sharded optimizer bytes to host memory.
- activations: ``layer_activation_bytes`` per layer and microbatch; 1F1B keeps ``pp - i`` microbatches in
  flight on stage ``i``; plus one layer's backward working set; the last stage's logits in bf16 and the
  fp32 copy the loss uses; pipeline send/receive buffers. This engine's peak is the larger of moments measured apart
  (plan/peak_moments.py). One rank holding every expert gets exactly top-k routed copies per token; the imbalance
  factor applies over expert-parallel ranks.
- constants and factors from planner.yaml: fixed workspaces, communication buffers, allocator overhead.
- Image models (``ModelShape.frozen_encoder_params``): the first stage holds the encoders. Megatron's layout: all of
  them frozen bf16. This engine's: the towers frozen (parameters only, ``_frozen_params_gib``), the projection
  (``encoder_projection_params``) trained like the decoder unless ``TrainingSetup.train_projection`` is off.
- LoRA (``TrainingSetup.lora``, plan/lora.py): the frozen base keeps its parameters only (bf16; in this engine
  under any layout); the adapters have parameters, gradients and optimizer state; activations as plan/lora.py says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from openrecipes.config.layout import LayoutConfig, expert_data_parallel_size
from openrecipes.config.recompute_names import RECOMPUTE_GRANULARITIES, WHOLE_LAYER_GRANULARITIES
from openrecipes.plan.hardware import GIB, Hardware, MemoryOverheads
from openrecipes.plan.lora import (LoraSetup, adapter_params, expert_adapter_bytes_per_copy,
                                  rank_product_bytes_per_token)
from openrecipes.plan.peak_moments import loss_bytes, openrecipes_peak
from openrecipes.plan.shape import ModelShape

OPTIMIZERS = {"adam": 12, "precision-aware": 6}  # sharded optimizer-state bytes per parameter
GRAD_BYTES = {"fp32": 4, "bf16": 2}
ENGINES = ("megatron", "openrecipes")
# Compiled blocks also save fewer tensors for the backward of the layers they keep (fused elementwise work): the share
# of the eager activations a layer without full recompute keeps, from the same measurements
OPENRECIPES_COMPILED_ACTIVATION_SHARE = 0.85
# A training process's own host memory besides what it offloads (Python, torch and CUDA libraries, the rows it reads):
# an allowance. A CPU process of the tiny model peaks near 0.3 GiB (measured); a CUDA process's host side is not
# measured here. The offloaded state dominates whenever host memory is short.
HOST_PROCESS_GIB = 1.0


@dataclass(kw_only=True, frozen=True)
class TrainingSetup:
    recompute: str = "full"
    optimizer: str = "adam"
    offload_fraction: float = 0.0
    offload_update: str = "host"  # where offloaded state is updated: the CPU (host, Megatron's) or the GPU (device)
    grad_dtype: str = "fp32"
    global_batch_tokens: int = 128 * 8192
    engine: str = "megatron"  # whose memory layout: "megatron" (the seeds') or "openrecipes" (this engine's)
    lora: LoraSetup | None = None  # adapters on a frozen base
    train_projection: bool = True  # this engine: an image model's projection trains (its towers never do)
    loss_chunk_tokens: int = 0  # > 0: the LM head and loss run this many tokens at a time (kernels.loss_chunk_tokens)
    offload_activations: bool = False  # the layers' saved activations wait in host memory (offload.activations)
    compiled: bool = False  # kernels.compile: this engine's compiled blocks and fused loss
    # kernels.allocator: "expandable" segments need less reserve above the allocated peak. A recipe's setup passes its
    # own (plan/host.recipe_setup, default expandable); without a recipe (`openrecipes plan`, the seeds' runs of other
    # frameworks) the planner assumes torch's default allocator, the larger reserve
    allocator: str = "caching"
    # kernels.attention: which attention path runs, where the paths hold different tensors (sink_mask_bytes)
    attention_kernel: str = "auto"
    # recompute applies to the first this many layers of each stage, the rest keep every activation (the block
    # method); None: every layer (uniform)
    recompute_layers: int | None = None
    # bytes of optimizer state per parameter when the recipe says exactly (master or remainder + two moments);
    # None: by ``optimizer``
    optimizer_state_bytes: float | None = None

    def state_bytes(self) -> float:
        return self.optimizer_state_bytes if self.optimizer_state_bytes is not None else OPTIMIZERS[self.optimizer]

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"recompute: {self.recompute!r} is not one of {', '.join(RECOMPUTE_GRANULARITIES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction: must be within [0, 1], got {self.offload_fraction}")
        if self.offload_update not in ("host", "device"):
            raise ValueError(f"offload_update: {self.offload_update!r} is not one of host, device")
        if self.grad_dtype not in GRAD_BYTES:
            raise ValueError(f"grad_dtype: {self.grad_dtype!r} is not one of {', '.join(GRAD_BYTES)}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens: must be 0 (off) or positive, got {self.loss_chunk_tokens}")
        if self.global_batch_tokens < 1:
            raise ValueError(f"global_batch_tokens: must be positive, got {self.global_batch_tokens}")


@dataclass(kw_only=True)
class StageMemory:
    stage: int
    layers: int
    inflight_microbatches: int
    parts_gib: dict[str, float] = field(default_factory=dict)
    allocated_gib: float = 0.0  # comparable with torch.cuda.max_memory_allocated
    reserved_gib: float = 0.0  # what has to fit: allocated x allocator overhead + CUDA context
    cpu_optimizer_gib: float = 0.0  # host memory for the offloaded optimizer state
    host_parts_gib: dict[str, float] = field(default_factory=dict)  # host memory of one rank of this stage
    host_gib: float = 0.0  # their sum


def microbatches_per_step(layout: LayoutConfig, setup: TrainingSetup) -> int:
    per_microbatch = layout.dp * layout.cp * layout.max_tokens_per_gpu
    return max(1, -(-setup.global_batch_tokens // per_microbatch))


def stage_params(shape: ModelShape, layout: LayoutConfig, layers: int, *, first: bool, last: bool,
                 engine: str = "megatron") -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of a stage. Megatron splits the vocabulary of the embedding and
    the LM head over TP; this engine (``engine="openrecipes"``) keeps both whole on every TP rank (each embeds and
    projects its own sequence-parallel tokens; the families' sharding plans list them as replicated)."""
    # Muse's latent projections are whole on every TP rank (Megatron-Core builds them as "duplicated" linears; our
    # sharding plan lists them as replicated): each rank applies them to its sequence-parallel tokens
    dense = layers * (shape.attention_params / layout.tp + shape.latent_params
                      + shape.feed_forward_dense_params() + shape.small_params_per_layer)
    vocab_split = layout.tp if engine == "megatron" else 1
    if first:
        dense += shape.embedding_params / vocab_split
    if last:
        dense += shape.lm_head_params / vocab_split + shape.hidden
    experts = layers * shape.moe_layer_fraction * (shape.num_experts / layout.ep) * shape.expert_params / layout.etp
    if last and shape.mtp_layers:  # whole MoE layers (attention split by TP like the others') and their own
        dense += shape.mtp_layers * (shape.mtp_layer_dense_params() - shape.attention_params * (1 - 1 / layout.tp))
        experts += shape.mtp_layers * (shape.num_experts / layout.ep) * shape.expert_params / layout.etp
    return dense, experts


def layer_activation_bytes(shape: ModelShape, layout: LayoutConfig, recompute: str, imbalance: float,
                           lora: LoraSetup | None = None) -> float:
    """Bytes one rank keeps for one layer and one microbatch when nothing is recomputed (``none``),
    when core attention and the expert activation are recomputed (``selective``); for ``full`` this is the
    working set rebuilt during backward. bf16 = 2 bytes per element.

    Per token, in elements: hidden-width tensors (norm inputs, projection inputs, the fp32 router input,
    residual-gate inputs) are split over TP only with sequence parallelism; head-width tensors (q, k, v
    before and after Q/K norm and RoPE, attention output, output norm and gate) are split over TP; the
    latent per-token tensors follow the hidden ones; each of the top-k routed copies keeps the expert input
    and output (expert width) and the SwiGLU input and output (expert FFN width, split by ETP). With ``lora``, frozen
    experts without adapters drop the expert input (only their weight gradients read it) and every linear adapter
    keeps its rank-r product.
    """
    tokens = layout.max_tokens_per_gpu
    h_tokens = tokens / layout.tp if layout.sequence_parallel else tokens
    head_tokens = tokens / layout.tp
    H, q, kv = shape.hidden, shape.q_width, shape.kv_width
    hidden_elems = 2 * H + 2 * H  # attention: norm input, q/k/v (and gate) projection input
    hidden_elems += 2 * H + 2 * H  # MoE: norm input, router / down-projection input
    if shape.router_fp32:
        hidden_elems += 2 * H  # fp32 copy of the router input (2 bf16 units)
    if shape.residual_gates:
        hidden_elems += 2 * 2 * H  # inputs of the two residual-gate multiplies
    hidden_elems += 8 * shape.latent  # latent: down output, pre-norm output, combine output, post-norm output
    router_bytes = 8 * shape.num_experts  # fp32 logits and scores
    head_elems = 2 * (q + kv) + (2 * q + 4 * kv) + 2 * q  # q/k before norm, q/k/v after, attention output
    if shape.attention_output_norm:
        head_elems += 2 * q
    if shape.attention_output_gate:
        head_elems += 2 * q + 2 * q  # sigmoid gate, gated output (output projection input)
    lse_bytes = 4 * shape.heads
    per_copy = 4 * shape.expert_in + 6 * shape.expert_ffn / layout.etp
    if recompute == "selective":
        per_copy -= 2 * shape.expert_ffn / layout.etp  # SwiGLU output rebuilt from its input
        lse_bytes = 0
    elif recompute == "attention_core":
        lse_bytes = 0  # the kernel's softmax statistics are rebuilt; q, k, v and its output stay
    elif recompute == "experts":
        per_copy = 4 * shape.expert_in  # the experts keep their input and output only
    adapters = 0.0
    if lora is not None:
        adapters = tokens * rank_product_bytes_per_token(shape, layout, lora)
        if recompute != "experts":  # recomputed experts rebuild what their adapters read with the rest
            per_copy += expert_adapter_bytes_per_copy(shape, layout, lora)
        if not lora.experts:
            per_copy -= 2 * shape.expert_in
    copies = tokens / layout.tp * shape.top_k * layout.etp * imbalance
    return (h_tokens * (hidden_elems + router_bytes) + head_tokens * (head_elems + lse_bytes)
            + copies * per_copy + adapters)


def sink_mask_bytes(shape: ModelShape, layout: LayoutConfig, setup: TrainingSetup) -> float:
    """Bytes of the float mask this engine's SDPA path makes for attention sinks, one layer and one microbatch:
    (rows, heads / TP, T, T + 1) in bf16, kept by the kernel for the backward (models/common/attention.py; the
    ``flex`` path scales the output by the logsumexp instead and makes none). 0 for a model without sinks."""
    if not shape.attention_sinks or setup.engine != "openrecipes" or setup.attention_kernel not in ("auto", "sdpa"):
        return 0.0
    row_tokens = layout.max_tokens_per_gpu / (layout.rows_per_microbatch or 1)
    return 2 * layout.max_tokens_per_gpu * shape.heads / layout.tp * (row_tokens + 1)


def kept_kernel_bytes(shape: ModelShape, layout: LayoutConfig) -> float:
    """Bytes the attention kernel keeps for one layer and one microbatch under ``full_keep_attention``: its q, k and v,
    its output (bf16) and its fp32 softmax statistics, over the head-split tokens."""
    head_tokens = layout.max_tokens_per_gpu / layout.tp
    return head_tokens * (2 * (2 * shape.q_width + 2 * shape.kv_width) + 4 * shape.heads)


def inflight(layout: LayoutConfig, stage: int, layers: int, microbatches: int) -> float:
    """Layer-microbatches whose activations stage ``stage`` holds at the 1F1B peak."""
    if layout.vpp == 1:
        return layers * min(layout.pp - stage, microbatches)
    chunks = (layout.pp - stage - 1) * 2 + (layout.vpp - 1) * layout.pp + 1
    return layers / layout.vpp * min(chunks, microbatches * layout.vpp)


def recomputed_share(setup: TrainingSetup, layers: int) -> float:
    """The share of a stage's ``layers`` that recompute (the block method's first N; every layer otherwise)."""
    if setup.recompute_layers is None or setup.recompute == "none" or layers == 0:
        return 1.0
    return min(layers, setup.recompute_layers) / layers


class LayerBytes(NamedTuple):
    """One layer's activation bytes for one microbatch, under the setup's recompute (``stage_memory``)."""

    full: float  # every activation, as a layer that keeps them all (and the working set's unit)
    kernel_kept: float  # what full_keep_attention keeps of the attention kernel
    stored: float  # what a recomputed (or selectively recomputed) layer keeps until its backward
    working: float  # the working set of the layer being run
    kept: float  # what a layer the block method leaves out keeps


def layer_bytes(shape: ModelShape, layout: LayoutConfig, setup: TrainingSetup, mem: MemoryOverheads) -> LayerBytes:
    """One layer's activation bytes for one microbatch: every activation (``layer_activation_bytes`` at none, plus
    the sink mask), what the setup's recompute keeps, the working set, and what an unrecomputed layer keeps."""
    tokens = layout.max_tokens_per_gpu
    h_tokens = tokens / layout.tp if layout.sequence_parallel else tokens
    lora = setup.lora
    compiled = setup.compiled and setup.engine == "openrecipes"
    # routed copies arrive unevenly only over several expert-parallel ranks: one rank with every expert gets them all
    imbalance = mem.moe_token_imbalance if layout.ep > 1 else 1.0
    # a sink mask is the kernel's: compiled blocks keep it whole, and recomputing the attention core rebuilds it
    sink_mask = sink_mask_bytes(shape, layout, setup)
    full_layer = layer_activation_bytes(shape, layout, "none", imbalance, lora) + sink_mask
    kernel_kept = kept_kernel_bytes(shape, layout) if setup.recompute == "full_keep_attention" else 0.0
    kernel_kept += sink_mask if setup.recompute == "full_keep_attention" else 0.0
    if setup.recompute in WHOLE_LAYER_GRANULARITIES:
        stored_per_layer = 2 * shape.hidden * h_tokens + kernel_kept  # the checkpointed layer input (and the kernel's)
    else:
        stored_per_layer = layer_activation_bytes(shape, layout, setup.recompute, imbalance, lora)
        if compiled:
            stored_per_layer *= OPENRECIPES_COMPILED_ACTIVATION_SHARE
        stored_per_layer += sink_mask if setup.recompute not in ("selective", "attention_core") else 0.0
    working = full_layer * (mem.working_set_multiplier - (setup.recompute not in WHOLE_LAYER_GRANULARITIES))
    # a layer the block method leaves out keeps every activation (fewer in a compiled block)
    kept_per_layer = ((full_layer - sink_mask) * (OPENRECIPES_COMPILED_ACTIVATION_SHARE if compiled else 1.0)
                      + sink_mask)
    return LayerBytes(full=full_layer, kernel_kept=kernel_kept, stored=stored_per_layer, working=working,
                      kept=kept_per_layer)


def stage_memory(shape: ModelShape, layout: LayoutConfig, counts: list[int], setup: TrainingSetup,
                 hw: Hardware) -> list[StageMemory]:
    mem = hw.memory
    edp = expert_data_parallel_size(layout)
    m = microbatches_per_step(layout, setup)
    state_bytes = setup.state_bytes()
    grad_bytes = GRAD_BYTES[setup.grad_dtype]
    if setup.grad_dtype == "bf16":
        state_bytes += 4  # fp32 gradient shard the optimizer step builds from bf16 gradients
    on_gpu = 1.0 - setup.offload_fraction
    h_tokens = layout.max_tokens_per_gpu / layout.tp if layout.sequence_parallel else layout.max_tokens_per_gpu
    compiled = setup.compiled and setup.engine == "openrecipes"
    full_layer, kernel_kept, stored_per_layer, working, kept_per_layer = layer_bytes(shape, layout, setup, mem)
    stages = []
    for i, layers in enumerate(counts):
        first, last = i == 0, i == len(counts) - 1
        dense, experts = stage_params(shape, layout, layers, first=first, last=last, engine=setup.engine)
        # what trains: the whole model, or with lora only the adapters (the frozen base has neither gradients nor
        # optimizer state)
        trained_dense, trained_experts = dense, experts
        if setup.lora is not None:
            trained_dense, trained_experts = adapter_params(shape, layout, setup.lora, layers)
        sharded_state = state_bytes * (trained_dense / (layout.dp * layout.cp) + trained_experts / edp)
        held = inflight(layout, i, layers, m)
        # the MTP layers (last stage) keep every activation: recompute and offload pass them by
        mtp_kept = full_layer * inflight(layout, i, shape.mtp_layers, m) if last else 0.0
        share = recomputed_share(setup, layers)
        stored = (share * stored_per_layer + (1 - share) * kept_per_layer) * held + mtp_kept
        stage_working = working
        if share < 1:
            # the block method recomputes the first layers last in the backward, when the later layers' kept
            # activations are already freed: the peak is the larger of the backward's start and that recompute
            recompute_peak = share * stored_per_layer * held + working
            stage_working = max(full_layer * (mem.working_set_multiplier - 1), recompute_peak - stored)
        transient, loss = stage_working, 0.0
        if last:
            logits, loss = loss_bytes(shape, layout, engine=setup.engine, loss_chunk_tokens=setup.loss_chunk_tokens,
                                      compiled=compiled, fixed_overhead_gib=mem.fixed_overhead_gib)
            if shape.mtp_layers and not setup.loss_chunk_tokens:  # each depth's logits live until the backward
                logits, loss = logits * (1 + shape.mtp_layers), loss * (1 + shape.mtp_layers)
            transient = max(stage_working, logits)
        p2p = 2 * 2 * shape.hidden * h_tokens if layout.pp > 1 else 0.0
        in_flight = stored_per_layer if share == 1 else max(stored_per_layer, kept_per_layer)
        # offloaded: the layers' saved tensors wait on the host (one layer's are in flight on the device); the kept
        # kernel's tensors stay on the device (saved outside the offload hooks)
        stored_at_peak = in_flight + kernel_kept * share * held + mtp_kept if setup.offload_activations else stored
        buffers = mem.fixed_overhead_gib + (mem.comm_buffer_gib if setup.engine == "megatron" else 0.0)
        if setup.engine == "openrecipes":
            weights = openrecipes_weight_gib(shape, layout, setup, layers, first=first, last=last)
            # every layer's kept kernel tensors are still alive when the backward ends (call v, 22 layers)
            end = full_layer * (OPENRECIPES_COMPILED_ACTIVATION_SHARE if compiled else 1.0) + kernel_kept * held
            weights, stored_at_peak, transient, buffers = openrecipes_peak(
                weights, stored_at_peak, transient, buffers, loss=loss, end=end, working=stage_working, pp=layout.pp,
                microbatches=m, chunked=bool(setup.loss_chunk_tokens))
        else:
            weights = _peer_weights_gib(shape, setup, params=dense + experts, trained=trained_dense + trained_experts,
                                        optimizer_bytes=sharded_state * on_gpu, first=first)
        parts = {
            **weights,
            "activations": (stored_at_peak + p2p) / GIB,
            "transient": transient / GIB,
            "buffers": buffers,
        }
        allocated = sum(parts.values())
        stages.append(StageMemory(
            stage=i, layers=layers, inflight_microbatches=min(layout.pp - i, m),
            parts_gib={k: round(v, 3) for k, v in parts.items()},
            allocated_gib=allocated,
            reserved_gib=reserved_gib(allocated, setup.allocator, mem),
            cpu_optimizer_gib=sharded_state * setup.offload_fraction / GIB,
        ))
        state_elements = dense / (layout.dp * layout.cp) + experts / edp
        if setup.engine == "openrecipes":  # no state sharded over cp or edp; with dp = 1 none sharded at all
            state_elements = _openrecipes_state_elements(trained_dense, trained_experts, layout)
            stages[-1].cpu_optimizer_gib = state_bytes * state_elements * setup.offload_fraction / GIB
        stages[-1].host_parts_gib = host_parts_gib(
            offloaded_elements=state_elements * setup.offload_fraction,
            # streamed through the GPU (offload_update device), the update reads the gradients where they are
            state_bytes=state_bytes, grad_bytes=grad_bytes if setup.offload_update == "host" else 0,
            activations=stored * setup.offload_activations)
        stages[-1].host_gib = sum(stages[-1].host_parts_gib.values())
    return stages


def _peer_weights_gib(shape: ModelShape, setup: TrainingSetup, *, params: float, trained: float,
                      optimizer_bytes: float, first: bool) -> dict[str, float]:
    """A peer engine's weights, gradients and optimizer state on one rank (GiB): bf16 parameters (with LoRA also
    the adapters beside the frozen base), gradients of what trains, the optimizer state left on the GPU."""
    kept = params + (trained if setup.lora is not None else 0.0)
    # the first stage also holds the frozen other-modality encoders of a whole-model trainer, taken as whole on
    # every rank (not split by TP: an assumption the seed's TP4 first-stage peaks agree with)
    frozen = 2 * shape.frozen_encoder_params if first else 0.0
    return {"params": (2 * kept + frozen) / GIB, "grads": GRAD_BYTES[setup.grad_dtype] * trained / GIB,
            "optimizer": optimizer_bytes / GIB}


def reserved_gib(allocated_gib: float, allocator: str, mem: MemoryOverheads) -> float:
    """What the caching allocator reserves for ``allocated_gib`` allocated, with the CUDA context."""
    overhead = mem.expandable_allocator_overhead if allocator == "expandable" else mem.allocator_overhead
    return allocated_gib * overhead + mem.cuda_context_gib


def host_parts_gib(*, offloaded_elements: float, state_bytes: float, grad_bytes: float, activations: float
                   ) -> dict[str, float]:
    """Host memory of one rank (GiB): the optimizer state it keeps on the CPU (pinned on a GPU host: master or
    remainder and moments, per ``state_bytes``), the host copies of those parameters' gradients the CPU update reads
    (all alive during the step), the offloaded activations, and the process itself (``HOST_PROCESS_GIB``)."""
    return {"optimizer_state": offloaded_elements * state_bytes / GIB,
            "gradient_copies": offloaded_elements * grad_bytes / GIB,
            "activations": activations / GIB,
            "process": HOST_PROCESS_GIB}


def sharded_elements(dense: float, experts: float, layout: LayoutConfig) -> float:
    """Parameters one rank of several keeps between steps, of the (dense, expert) ones its stage holds: FSDP2 shards
    the dense ones over dp; the experts are already this rank's under ep·etp > 1, else FSDP shards them too."""
    return dense / layout.dp + (experts if layout.ep * layout.etp > 1 else experts / layout.dp)


def _openrecipes_state_elements(dense: float, experts: float, layout: LayoutConfig) -> float:
    """Elements of optimizer state one rank of this engine keeps, of the trained (dense, expert) ones its stage
    holds: all of them without FSDP2 (dp = 1), else its FSDP2 shards (``sharded_elements``)."""
    return dense + experts if layout.dp == 1 else sharded_elements(dense, experts, layout)


def openrecipes_weight_gib(shape: ModelShape, layout: LayoutConfig, setup: TrainingSetup, layers: int, *,
                           first: bool, last: bool) -> dict[str, float]:
    """This engine's parameters, gradients and optimizer state on one rank of a stage (GiB, unrounded: the parts
    ``stage_memory`` reports). The weights as the engine splits them (``stage_params`` with ``engine="openrecipes"``:
    attention by TP; embedding, LM head, router and norms whole on every TP rank; everything whole on every CP rank;
    experts by EP and ETP), stored as ``_openrecipes_weights`` says. An image model's encoders sit on the first
    stage, whole in FSDP's root unit: the towers frozen (their parameters only), the projection trained like the
    decoder unless the recipe freezes it."""
    dense, experts = stage_params(shape, layout, layers, first=first, last=last, engine="openrecipes")
    microbatches, on_gpu, lora = microbatches_per_step(layout, setup), 1.0 - setup.offload_fraction, setup.lora
    encoder = shape.frozen_encoder_params if first else 0
    projection = shape.encoder_projection_params if first and setup.train_projection else 0
    root = shape.embedding_params * first + shape.lm_head_params * last + projection
    weights = _openrecipes_weights(dense + projection, experts, layout, setup, microbatches, layers, on_gpu, root=root,
                                   frozen=lora is not None)
    if lora is not None:  # the adapters' share of every part, the base's parameters
        trained_dense, trained_experts = adapter_params(shape, layout, lora, layers)
        adapters = _openrecipes_weights(trained_dense + projection, trained_experts, layout, setup, microbatches,
                                        layers, on_gpu, root=0.0)
        weights = {**adapters, "params": weights["params"] + adapters["params"]}
    weights["params"] += _frozen_params_gib(encoder - projection, layout, setup)
    return weights


def _frozen_params_gib(params: float, layout: LayoutConfig, setup: TrainingSetup) -> float:
    """Frozen parameters in this engine (no gradients, no optimizer state): bf16 without FSDP2 (one process, or dp =
    1); under FSDP2 their shard (fp32; bf16 with the precision-aware optimizer or under LoRA, whose base stays bf16)
    and the bf16 copy gathered for the step (root unit)."""
    if layout.dp == 1:
        return 2 * params / GIB
    stored = 2 if setup.optimizer == "precision-aware" or setup.lora is not None else 4
    return (stored * params / layout.dp + 2 * params) / GIB


def _openrecipes_weights(dense: float, experts: float, layout: LayoutConfig, setup: TrainingSetup, microbatches: int,
                         layers: int, on_gpu: float, *, root: float, frozen: bool = False) -> dict[str, float]:
    """This engine's weight-side memory (docs/train.md) of the (dense, expert) parameters one rank holds: without
    FSDP2 (one process, or several with dp = 1: TP, CP, PP and EP leave each rank its split of the weights whole)
    bf16 parameters, bf16 gradients with one microbatch (fp32 accumulators with several) and unsharded optimizer
    state; with dp > 1 FSDP2 shards over dp (``sharded_elements``) either fp32 masters, gradients and moments (adam)
    or bf16 parameters with remainders and bf16 moments (precision-aware), plus the bf16 copies FSDP gathers: the
    root unit (embedding and LM head, ``root`` parameters, gathered for the whole step) and about two layers at a
    time. ``frozen``: a LoRA run's base, parameters only and bf16 under any layout (no gradients, no optimizer state,
    so no fp32 masters)."""
    if layout.dp == 1:
        grad_bytes = 0 if frozen else 2 if microbatches == 1 else 4
        state_bytes = 0 if frozen else setup.state_bytes()
        return {"params": 2 * (dense + experts) / GIB, "grads": grad_bytes * (dense + experts) / GIB,
                "optimizer": state_bytes * (dense + experts) * on_gpu / GIB}
    sharded = sharded_elements(dense, experts, layout)
    gathered = 2 * root + 2 * 2 * (dense - root + (0 if layout.ep * layout.etp > 1 else experts)) / max(1, layers)
    if frozen:
        return {"params": (2 * sharded + gathered) / GIB, "grads": 0.0, "optimizer": 0.0}
    if setup.optimizer == "precision-aware":  # bf16 shards + int16 remainders, bf16 moments
        grad_bytes = 2 if microbatches == 1 else 4
        return {"params": (2 * sharded + gathered) / GIB, "grads": grad_bytes * sharded / GIB,
                "optimizer": setup.state_bytes() * sharded * on_gpu / GIB}
    return {"params": (4 * sharded + gathered) / GIB, "grads": 4 * sharded / GIB, "optimizer": 8 * sharded / GIB}
