"""kernels.compile on CUDA: compiled attention and MoE blocks (grouped GEMMs, bf16) against the eager model, under
each recompute mode, and on packed documents (varlen attention). Both bf16 runs are judged against an fp32 run of
the same weights: the compiled one may round differently (fused intermediates stay in fp32), not worse."""

import pytest
import torch

from openrecipes.models.common.attention import Documents
from openrecipes.models.common.kernels import KernelOptions
from openrecipes.models.qwen3_moe.family import FAMILY
from openrecipes.parallel.compile import apply_compile
from openrecipes.parallel.recompute import apply_recompute
from openrecipes.train.engine import loss_function

pytestmark = pytest.mark.gpu


def loss_and_grads(dtype: torch.dtype, compiled: bool, granularity: str, packed: bool):
    config = FAMILY.named_configs["qwen3-moe-tiny"]()
    # the fp32 oracle: dense masked attention and the exact per-expert loop. Routing is balanced: with a tiny model a
    # last-bit difference in the router's logits flips near-tied expert choices, which is not what is tested here
    kernels = KernelOptions(balanced_routing=True) if dtype == torch.bfloat16 else \
        KernelOptions(attention="reference", experts="loop", balanced_routing=True)
    model = FAMILY.build(config, device="cuda", dtype=torch.float32, seed=0, kernels=kernels).to(dtype)
    layers = list(model.model.layers.values())
    blocks = [m for layer in layers for m in (layer.self_attn, layer.mlp)]
    recomputed = apply_recompute(layers, granularity=granularity, attention_of=lambda layer: layer.self_attn)
    if compiled:
        expected = len([b for b in blocks if all(b is not r for r in recomputed)])
        assert apply_compile(blocks, recomputed=recomputed) == expected
    ids = torch.randint(0, config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    documents = None
    if packed:
        doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate([100, 56, 100])])
        documents = Documents.from_document_ids(torch.stack([doc_ids, doc_ids + 5]).cuda())
    logits = model(ids, documents=documents)
    weights = torch.ones(ids.shape, device="cuda")
    loss = loss_function(compiled)(logits, ids.roll(-1, 1), weights) / weights.sum()
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("granularity,packed", [("full", False), ("selective", True), ("none", True),
                                                      ("full_keep_attention", False), ("full_keep_attention", True)])
def test_compiled_blocks_round_no_worse_than_eager(granularity, packed):
    ref_loss, ref = loss_and_grads(torch.float32, False, granularity, packed)
    eager_loss, eager = loss_and_grads(torch.bfloat16, False, granularity, packed)
    loss, grads = loss_and_grads(torch.bfloat16, True, granularity, packed)
    assert grads.keys() == eager.keys() == ref.keys()
    assert abs(loss - ref_loss) <= 2 * abs(eager_loss - ref_loss) + 1e-3
    for name, grad in grads.items():
        scale = ref[name].norm().clamp_min(1e-12)
        compiled_error = ((grad - ref[name]).norm() / scale).item()
        eager_error = ((eager[name] - ref[name]).norm() / scale).item()
        assert compiled_error <= 2 * eager_error + 1e-3, (name, compiled_error, eager_error)


def test_packed_rows_never_recompile_a_compiled_block_on_cuda():
    """Varlen attention takes the longest document's length: a new length must not retrace the block."""
    from openrecipes.config.recipe import Kernels
    from openrecipes.parallel.compile import dynamic_document_count
    from openrecipes.parallel.mesh import single_process
    from openrecipes.parallel.parallelize import ParallelizeOptions, parallelize
    from tests.parallel.dynamo_logs import recompile_reasons

    torch._dynamo.reset()
    config = FAMILY.named_configs["qwen3-moe-tiny"]()
    model = FAMILY.build(config, device="cuda", dtype=torch.bfloat16, seed=0)
    parallelize(model, single_process(torch.device("cuda")), ParallelizeOptions(
        compute_dtype=torch.bfloat16, parameter_dtype=torch.bfloat16, seed=0, kernels=Kernels(compile=True)))
    tokens = 256
    with recompile_reasons() as reasons:
        for step, ends in enumerate(([100, 256], [30, 90, 200, 256], [250, 256], [10, 20, 256])):
            ids = torch.zeros(1, tokens, dtype=torch.long)
            for index, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
                ids[0, start:end] = index
            documents = dynamic_document_count(Documents.from_document_ids(ids.cuda()))
            tokens_in = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
            model(tokens_in, documents=documents).float().pow(2).mean().backward()
            if step == 0:  # the first microbatch compiles every block (one per layer); later ones may not
                first = len(reasons)
    blocks = [r for r in reasons[first:] if r.startswith("Recompiling function forward")]
    assert not blocks, blocks
