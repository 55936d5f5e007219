"""On a GPU, the memory knobs lower device memory: activation offload (what layers keep for the backward) and the
chunked loss (the peak of the LM head + cross entropy), each computing the same numbers."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_activation_offload_lowers_what_the_forward_leaves_on_the_device():
    from openrecipes.parallel.activation_offload import apply_activation_offload

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()).cuda() for _ in range(4)]
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)

    def forward_and_backward():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        h = x
        for layer in layers:
            h = layer(h)
        kept = torch.cuda.memory_allocated() - start - h.numel() * h.element_size()
        h.square().sum().backward()
        grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        return kept, grads

    plain, expected = forward_and_backward()
    apply_activation_offload(layers)
    offloaded, got = forward_and_backward()
    assert offloaded < plain / 4
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_chunked_loss_peak_is_a_fraction_of_the_logits_path():
    from openrecipes.train.chunked_loss import linear_cross_entropy
    from openrecipes.train.engine import token_loss_sum

    torch.manual_seed(0)
    tokens, vocab, width = 8192, 32768, 1024
    h = (torch.randn(tokens, width, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    weights = (torch.rand(tokens, device="cuda") > 0.3).float()

    def peak(loss_fn):
        h.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = loss_fn()
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, loss.detach(), h.grad.clone(), weight.grad.clone()

    reference = peak(lambda: token_loss_sum(F.linear(h, weight), targets, weights))
    chunked = peak(lambda: linear_cross_entropy(h, weight, targets, weights, chunk=1024))
    assert chunked[0] < reference[0] / 3
    torch.testing.assert_close(chunked[1], reference[1], rtol=1e-4, atol=1e-2)
    # both bf16 paths against the same products in fp32: elementwise, bf16 gradients differ by an ulp where the
    # softmax and the target's one-hot nearly cancel, so each is judged by its error against the oracle
    h32, w32 = h.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    token_loss_sum(F.linear(h32, w32), targets, weights).backward()
    for got, bf16, oracle in ((chunked[2], reference[2], h32.grad), (chunked[3], reference[3], w32.grad)):
        scale = oracle.norm()
        chunked_error = ((got.float() - oracle).norm() / scale).item()
        unchunked_error = ((bf16.float() - oracle).norm() / scale).item()
        assert chunked_error <= 1.5 * unchunked_error + 1e-4, (chunked_error, unchunked_error)
