"""The chunked LM head + loss (kernels.loss_chunk_tokens) against today's path: logits, then token_loss_sum."""

import pytest
import torch
import torch.nn.functional as F

from openrecipes.models.muse_spark.model import soft_cap
from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.train import engine
from openrecipes.train.chunked_loss import linear_cross_entropy
from openrecipes.parallel.mesh import single_process


def _reference(h, weight, targets, weights, softcap):
    logits = F.linear(h, weight)
    if softcap is not None:
        logits = soft_cap(logits, softcap)
    return engine.token_loss_sum(logits, targets, weights)


# fp32 (the loss is computed in fp32 on either path): gradients sum the chunks' partial products in another order
TOL = {"rtol": 1e-6, "atol": 1e-5}


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_loss_and_gradients_match_the_logits_path(softcap):
    """37-word vocabulary, 2 x 15 tokens in chunks of 8 (the last chunk short), a third of the tokens masked."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 15, 16, generator=gen, requires_grad=True)
    weight = torch.randn(37, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 37, (2, 15), generator=gen)
    weights = (torch.rand(2, 15, generator=gen) > 0.33).float()
    results = []
    for loss_fn in (lambda: _reference(h, weight, targets, weights, softcap),
                    lambda: linear_cross_entropy(h, weight, targets, weights, chunk=8, softcap=softcap)):
        loss = loss_fn()
        grad_h, grad_w = torch.autograd.grad(loss * 0.7, (h, weight))  # a non-unit upstream gradient
        results.append((loss, grad_h, grad_w))
    (ref, ref_h, ref_w), (got, got_h, got_w) = results
    assert weights.sum() < weights.numel() and got_h[weights == 0].abs().sum() == 0  # masked tokens get no gradient
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, ref_h, **TOL)
    torch.testing.assert_close(got_w, ref_w, **TOL)


def _saved_bytes(run) -> int:
    """The largest tensor autograd saves for the backward while ``run`` builds the graph."""
    largest = [0]

    def pack(tensor):
        largest[0] = max(largest[0], tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return largest[0]


def test_no_tensor_of_all_the_logits_is_kept():
    tokens, vocab, width = 64, 500, 8
    h = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets, weights = torch.randint(0, vocab, (tokens,)), torch.ones(tokens)
    logits_bytes = tokens * vocab * 4
    assert _saved_bytes(lambda: _reference(h, weight, targets, weights, None)) >= logits_bytes
    # the chunked path keeps the head's input and weight and one float a token, never (tokens x vocab)
    assert _saved_bytes(lambda: linear_cross_entropy(h, weight, targets, weights, chunk=16)) < logits_bytes / 4


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "muse-spark-tiny"])
def test_model_step_matches_the_logits_path(make_recipe, model):
    """Whole model, fp32, packed (THD) rows with loss masks: same loss and same gradient of every parameter; the
    tokens (2 rows x 64) are not a multiple of the chunk. Muse Spark's head is soft-capped."""
    from openrecipes.data.batching import RowLoader, load_rows

    losses, grads = [], []
    for chunk in (0, 48):
        recipe = make_recipe(model=model, kernels__loss_chunk_tokens=chunk)
        torch.manual_seed(0)
        built, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
        loader = RowLoader(dataset=load_rows(recipe.data.rows), global_batch=2, dp_rank=0, dp_size=1,
                           rows_per_microbatch=2)
        # the first step whose rows hold a document boundary and unsupervised tokens (packed, masked)
        batch = next(b for step in range(len(loader.dataset) // 2) for (b,) in [loader.microbatches(step)]
                     if (b["position_ids"][:, 1:] == 0).any() and (b["loss_mask"] == 0).any())
        loss = engine.microbatch_loss_sum(built, batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad for name, p in built.named_parameters()})
    assert type(built.lm_head).__name__ == "ChunkedLossHead"
    assert grads[0].keys() == grads[1].keys() and "lm_head.weight" in grads[1]
    torch.testing.assert_close(losses[1], losses[0], **TOL)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, **TOL, msg=name)
