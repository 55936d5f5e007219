"""``kernels.compile``: torch.compile each decoder layer's attention and MoE blocks, applied from outside the model.

What it buys: the element-wise work around the matrix multiplies (q/k norms, RoPE, casts, the router's softmax and
top-k, the gated activation and its routing weights, the permutations) fused into fewer kernels, and fewer kernel
launches per layer, so less host time between them.

Why the blocks and not the whole layer: activation recompute hooks the layer (``torch.distributed._composable``'s
``checkpoint`` enters a context manager in a forward hook, which Dynamo cannot trace), so compiled regions sit below
the recompute boundary, and a block that is itself recomputed (selective recompute: the attention block) stays eager.
Each block is compiled with ``nn.Module.compile``: its forward and parameter names stay as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from openrecipes.models.common.attention import Documents


def apply_compile(blocks: list[nn.Module], *, recomputed: list[nn.Module]) -> int:
    """Compile every module of ``blocks`` that is not in ``recomputed``. Returns how many were compiled."""
    skipped = {id(module) for module in recomputed}
    chosen = [block for block in blocks if id(block) not in skipped]
    if chosen:
        longest_document_is_dynamic()
    for block in chosen:
        # not fullgraph: the exact per-expert loop (CPU, fp32) reads expert counts on the host and breaks the graph;
        # the CUDA grouped-GEMM path traces whole
        block.compile()
    return len(chosen)


# the blocks' argument holding the documents (models/*/model.py: ``forward(x_BTD, angles_BTF, documents)``)
LONGEST_DOCUMENT_SOURCE = "L['documents'].max_seqlen"


def longest_document_is_dynamic() -> None:
    """Trace the longest document's length (a host int the varlen kernel takes) as a symbol from the first trace.
    Dynamo specialises a Python int on first sight, so packed rows whose longest document changes recompiled each
    block once, at whatever step first brought another length."""
    sources = [s for s in torch.compiler.config.dynamic_sources.split(",") if s]
    if LONGEST_DOCUMENT_SOURCE not in sources:
        torch.compiler.config.dynamic_sources = ",".join([*sources, LONGEST_DOCUMENT_SOURCE])


def inputs_require_grad(embedding: nn.Module) -> None:
    """Make a frozen embedding's output require grad while gradients are on. Dynamo guards a compiled frame on
    whether its input requires grad: on a frozen base (LoRA) the first layer's input would be the one that does not,
    and its block would compile a second time. The price is that first layer's input gradient, which is discarded."""

    def require_grad(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not output.requires_grad:
            return output.requires_grad_()
        return output

    embedding.register_forward_hook(require_grad)


def dynamic_document_count(documents: Documents) -> Documents:
    """``documents`` with their number marked dynamic for Dynamo before the first trace: compiled blocks read them,
    and packed rows bring a new number of documents at every step, which would recompile each block once (to a
    dynamic size) at whatever step first brings one."""
    torch._dynamo.maybe_mark_dynamic(documents.cu_seqlens, 0)
    return documents
