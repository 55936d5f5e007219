"""kernels.compile on packed rows: a compiled attention block is traced once, whatever the documents of the rows that
follow (their number, the longest one, a microbatch of whole rows), given the documents as the engine gives them
(``dynamic_document_count``), and computes what the uncompiled model does.

Dynamo's eager backend traces exactly what the engine's compile traces and needs no C++ compiler."""

import pytest
import torch
from torch import nn

from openrecipes.config.recipe import Kernels
from openrecipes.models.common.attention import Documents
from openrecipes.models.families import family_for_model
from openrecipes.models.deepseek_v3.family import FAMILY as DEEPSEEK
from openrecipes.models.muse_spark.family import FAMILY as MUSE
from openrecipes.models.qwen3_moe.family import FAMILY as QWEN3
from openrecipes.parallel.compile import dynamic_document_count
from openrecipes.parallel.mesh import single_process
from openrecipes.parallel.parallelize import ParallelizeOptions, parallelize
from tests.parallel.dynamo_logs import recompile_reasons

TOKENS = 16
# document ends of one row per microbatch: counts and longest documents that differ, then a whole row
LAYOUTS = ([5, 16], [3, 9, 16], [2, 4, 8, 11, 16], [7, 16], [16], [1, 2, 3, 16])


def _documents(ends: list[int]) -> Documents:
    ids = torch.zeros(1, TOKENS, dtype=torch.long)
    for index, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        ids[0, start:end] = index
    return dynamic_document_count(Documents.from_document_ids(ids))


def _build(family, name: str, compiled: bool) -> nn.Module:
    config = family.named_configs[name]()
    model = family.build(config, device="cpu", dtype=torch.float32, seed=0)
    parallelize(model, single_process(torch.device("cpu")), ParallelizeOptions(
        compute_dtype=torch.float32, parameter_dtype=torch.float32, seed=0, kernels=Kernels(compile=compiled)))
    return model


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, documents: Documents) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, documents=documents).float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family, name", [(QWEN3, "qwen3-moe-tiny"), (MUSE, "muse-spark-tiny"),
                                          (DEEPSEEK, "deepseek-v3-tiny")])
def test_compiled_attention_is_not_retraced_for_new_documents(monkeypatch, family, name) -> None:
    compile_block = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **options: compile_block(self, backend="eager"))
    torch._dynamo.reset()
    compiled, eager = _build(family, name, True), _build(family, name, False)
    assert family_for_model(compiled) is family
    generator = torch.Generator().manual_seed(0)
    with recompile_reasons() as reasons:
        for index, ends in enumerate(LAYOUTS):
            ids = torch.randint(0, compiled.config.vocab_size, (1, TOKENS), generator=generator)
            loss, grads = _loss_and_grads(compiled, ids, _documents(ends))
            reference_loss, reference_grads = _loss_and_grads(eager, ids, _documents(ends))
            torch.testing.assert_close(loss, reference_loss)
            assert grads.keys() == reference_grads.keys()
            for key in grads:
                torch.testing.assert_close(grads[key], reference_grads[key], msg=f"{ends}: {key}")
            if index == 0:  # layers of different kinds (a sliding window or none) compile a block each, once
                first = len(reasons)
    # the CPU per-expert loop's helpers (the host reads expert counts) may recompile; the blocks may not
    block_recompiles = [r for r in reasons[first:] if r.startswith("Recompiling function forward")]
    assert not block_recompiles, block_recompiles


class _ReadsLongestDocument(nn.Module):
    """A block that reads the longest document's length, as the CUDA varlen kernel's call does."""

    def forward(self, x_BTD: torch.Tensor, angles_BTF: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        return x_BTD * documents.max_seqlen + angles_BTF


def test_a_block_reading_the_longest_document_is_traced_once(monkeypatch) -> None:
    from openrecipes.parallel.compile import LONGEST_DOCUMENT_SOURCE, apply_compile

    compile_block = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **options: compile_block(self, backend="eager"))
    torch._dynamo.reset()
    block = _ReadsLongestDocument()
    # torch's own patch, not monkeypatch: pytest deletes on undo a config missing from the module's __dict__, and
    # torch then hides that config from every later test.
    with torch.compiler.config.patch(dynamic_sources=""), recompile_reasons() as reasons:
        apply_compile([block], recomputed=[])
        assert LONGEST_DOCUMENT_SOURCE in torch.compiler.config.dynamic_sources
        for ends in LAYOUTS[:4]:
            documents = _documents(ends)
            x = torch.randn(1, TOKENS, 4)
            torch.testing.assert_close(block(x, x, documents), x * documents.max_seqlen + x)
    assert not reasons, reasons


@pytest.mark.parametrize("family, name", [(QWEN3, "qwen3-moe-tiny"), (MUSE, "muse-spark-tiny"),
                                          (DEEPSEEK, "deepseek-v3-tiny")])
def test_every_compiled_block_names_its_documents_as_the_dynamic_source_says(monkeypatch, family, name) -> None:
    import inspect

    compiled_blocks = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **options: compiled_blocks.append(self))
    _build(family, name, True)
    takes_documents = [block for block in compiled_blocks
                       if "documents" in inspect.signature(block.forward).parameters]
    assert takes_documents  # the attention blocks: their argument is the one LONGEST_DOCUMENT_SOURCE names
