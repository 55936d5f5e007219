"""What is alive at the moments a stage's memory peaks: the loss, and (this engine) the end of the backward.

Apart from ``stage_memory`` because a peak is not the sum of all a stage ever holds: the logits, the layers' saved
activations and the gradients live at different times of the step, so this engine's peak is the larger of moments
measured apart (each phase's peak, debug.memory_trace, on one H200: calls t and v in BENCHMARKS.md). With one
microbatch on one stage: the backward's start at the loss (every layer's saved activations, the logits and their
gradient, no other gradient yet) against its end (every gradient, the first layer's activations); with several, the
loss beside every gradient accumulator; over several stages, the logits are gone before the gradients exist.
"""

from __future__ import annotations

from openrecipes.config.layout import LayoutConfig
from openrecipes.plan.hardware import GIB
from openrecipes.plan.shape import ModelShape

# This engine's loss: bf16 logits (2 B per token and vocabulary entry), the fp32 copy cross-entropy reads (4 B) and its
# fp32 log-softmax (4 B) are alive together for a moment, 6 B stay for the backward. 8 B is fitted to the memory
# phases of our DP2-EP2 and DP4-EP4 runs (both rise 15.4 GiB above the resident state; docs/plan.md).
OPENRECIPES_LOGITS_BYTES = 8
# Compiled blocks (kernels.compile) fuse the LM head's output into the loss: bytes per logits element alive at the
# loss, measured on one H200 (8 layers at Qwen3-30B-A3B widths, 1 and 4 rows of 8,192 tokens per microbatch; the
# memory-knob calls in BENCHMARKS.md)
OPENRECIPES_COMPILED_LOGITS_BYTES = 1.0
# With one microbatch a step, bytes per logits element when the backward starts at the loss (the logits and their
# gradient; eager also the fp32 log-softmax it saved), measured with each phase's peak (debug.memory_trace) on one
# H200: 4 rows of 8,192 tokens, 8 and 18 layers, compiled and eager (call t in BENCHMARKS.md)
LOSS_BACKWARD_BYTES = {"compiled": 4.0, "eager": 12.0}


def loss_bytes(shape: ModelShape, layout: LayoutConfig, *, engine: str, loss_chunk_tokens: int, compiled: bool,
               fixed_overhead_gib: float) -> tuple[float, float]:
    """(logits, loss) bytes on one rank of the last stage: what the forward holds at the loss, and (this engine, as
    ``openrecipes_peak`` reads it) what is alive when the backward starts there. ``compiled``: this engine's
    compiled blocks and fused loss; ``fixed_overhead_gib``: the fixed workspaces (planner.yaml)."""
    tokens = layout.max_tokens_per_gpu
    # bf16 logits from the LM head and the fp32 copy the loss works in (vocab split by TP); the chunked
    # loss holds one chunk's and an fp32 accumulator of the head's weight gradient
    logit_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens else tokens
    per_element = OPENRECIPES_LOGITS_BYTES if engine == "openrecipes" else 2 + 4
    if compiled and not loss_chunk_tokens:
        per_element = OPENRECIPES_COMPILED_LOGITS_BYTES
    logits = logit_tokens * shape.vocab / layout.tp * per_element
    if loss_chunk_tokens:
        logits += 4 * shape.lm_head_params / layout.tp
    # the loss when the backward starts there: unchunked, the logits, their gradient and the head's weight
    # gradient; chunked, one chunk's (``logits`` above: its own backward runs inside the forward)
    loss = (logit_tokens * shape.vocab / layout.tp * LOSS_BACKWARD_BYTES["compiled" if compiled else "eager"]
            + 2 * shape.lm_head_params / layout.tp)
    if loss_chunk_tokens:  # and the fixed overhead, fitted with it (32K rows, call p)
        loss = logits + fixed_overhead_gib * GIB
    return logits, loss


def openrecipes_peak(weights: dict[str, float], stored: float, transient: float, buffers: float, *, loss: float,
                     end: float, working: float, pp: int, microbatches: int, chunked: bool
                     ) -> tuple[dict[str, float], float, float, float]:
    """(weights GiB, activations, transient bytes, buffers GiB) of this engine at its peak, from what a stage holds:
    its ``weights`` parts, ``stored`` activations, ``transient`` bytes (the working set, or the logits if larger),
    ``buffers`` GiB, the ``loss`` and ``end`` bytes ``_one_microbatch_peak`` compares and the stage's backward
    ``working`` set. ``chunked``: the LM head and loss run a chunk of tokens at a time."""
    if pp == 1 and microbatches == 1:
        return _one_microbatch_peak(weights, stored, loss=loss, end=end)
    if pp == 1 and not chunked and microbatches > 1:
        # from the second microbatch on, the loss runs beside every gradient accumulator
        return weights, stored, max(loss, working), 0.0
    if pp == 1:
        # several microbatches: from the second on, the loss runs beside every gradient accumulator
        return weights, stored, max(transient, working), buffers
    # gradients exist only from the backward on (they are freed after each step), when the logits are
    # already gone: the peak is the larger of the two, not their sum
    return weights, stored, max(transient - weights["grads"] * GIB, working), buffers


def _one_microbatch_peak(weights: dict[str, float], stored: float, *, loss: float, end: float
                         ) -> tuple[dict[str, float], float, float, float]:
    """(weights GiB, activations, transient bytes, buffers GiB) of this engine at its peak with one microbatch a step,
    one stage and the unchunked loss: the larger of two moments, measured apart on one H200 (call t in
    BENCHMARKS.md). When the backward starts at the loss, every layer's saved activations are alive with the loss's
    ``loss`` bytes (logits, their gradient, the LM head's weight gradient) and no other gradient yet; at the end of
    the backward every gradient is alive with the ``end`` bytes of the first layer's activations, and the other
    layers' are freed. The parts say what is alive at the larger one."""
    at_loss, at_end = stored + loss, weights["grads"] * GIB + end
    if at_loss >= at_end:
        return {**weights, "grads": 0.0}, stored, loss, 0.0
    return weights, 0.0, end, 0.0

