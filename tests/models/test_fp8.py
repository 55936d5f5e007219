"""FP8 row-wise products against their definition, written here in FP64: each operand scaled along the summed
dimension (amax / 448 per row of the other), rounded to e4m3, multiplied exactly. On CPU the module computes the
definition itself (``emulate``); the CUDA kernels are held to the same reference by the GPU test below."""

import pytest
import torch

from openrecipes.models.common.fp8 import E4M3, _padding, fp8_grouped_linear, fp8_linear


def _reference_quantize(x: torch.Tensor, dim: int) -> torch.Tensor:
    """What the product reads: x rounded to e4m3 at its slice's scale, back in fp64."""
    scale = x.double().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12) / 448.0
    return (x.double() / scale).clamp(-448, 448).to(E4M3).double() * scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _linear_case(device, dtype):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(48, 64, generator=generator) * 3).to(device, dtype).requires_grad_()
    w = (torch.randn(32, 64, generator=generator) * 0.05).to(device, dtype).requires_grad_()
    grad = torch.randn(48, 32, generator=generator).to(device, dtype)
    return x, w, grad


def _check_linear(device, dtype, tolerance):
    x, w, grad = _linear_case(device, dtype)
    fp8_linear(x, w).backward(grad)
    expected = _reference_quantize(x, 1) @ _reference_quantize(w, 1).t()
    expected_dx = _reference_quantize(grad, 1) @ _reference_quantize(w.t(), 1).t()
    expected_dw = _reference_quantize(grad.t(), 1) @ _reference_quantize(x.t(), 1).t()
    assert _rel(fp8_linear(x, w), expected) <= tolerance
    assert _rel(x.grad, expected_dx) <= tolerance and _rel(w.grad, expected_dw) <= tolerance
    # and FP8 is what it claims: within e4m3's rounding of the exact product, not equal to it
    exact = x.double() @ w.double().t()
    assert 1e-3 < _rel(fp8_linear(x, w), exact) < 0.06


def test_linear_is_its_definition_on_cpu():
    _check_linear("cpu", torch.float32, 1e-6)


def _grouped_case(device, dtype, counts):
    generator = torch.Generator().manual_seed(1)
    rows, experts = sum(counts), len(counts)
    x = torch.randn(rows, 32, generator=generator).to(device, dtype).requires_grad_()
    w = (torch.randn(experts, 48, 32, generator=generator) * 0.1).to(device, dtype).requires_grad_()
    grad = torch.randn(rows, 48, generator=generator).to(device, dtype)
    return x, w, grad, torch.tensor(counts, device=device)


def _grouped_reference(x, w, grad, counts):
    """Per expert: the forward and the input gradient scale per row; the weight gradient sums each expert's rows,
    its operands scaled per column over all the rows."""
    out, dx, dw = [], [], []
    sizes = counts.tolist()
    columns_g, columns_x = _reference_quantize(grad, 0).split(sizes), _reference_quantize(x, 0).split(sizes)
    for e, (xe, ge) in enumerate(zip(x.split(sizes), grad.split(sizes))):
        out.append(_reference_quantize(xe, 1) @ _reference_quantize(w[e], 1).t())
        dx.append(_reference_quantize(ge, 1) @ _reference_quantize(w[e].t(), 1).t())
        dw.append(columns_g[e].t() @ columns_x[e])
    return torch.cat(out), torch.cat(dx), torch.stack(dw)


def _check_grouped(device, dtype, counts, tolerance):
    x, w, grad, counts_E = _grouped_case(device, dtype, counts)
    out = fp8_grouped_linear(x, w, counts_E)
    out.backward(grad)
    expected, expected_dx, expected_dw = _grouped_reference(x, w, grad, counts_E.cpu())
    assert _rel(out, expected) <= tolerance
    assert _rel(x.grad, expected_dx) <= tolerance and _rel(w.grad, expected_dw) <= tolerance


@pytest.mark.parametrize("counts", [[16, 0, 32, 16], [5, 11, 0, 9]], ids=["aligned", "ragged"])
def test_grouped_is_its_definition_on_cpu(counts):
    _check_grouped("cpu", torch.float32, counts, 1e-6)


def test_weight_gradient_scales_are_shared_by_the_experts():
    # an expert whose values are 1,000x smaller than another's keeps its relative precision under the shared scale
    x, w, grad, counts_E = _grouped_case("cpu", torch.float32, [16, 16])
    with torch.no_grad():
        x[16:] *= 1e-3
    fp8_grouped_linear(x, w, counts_E).backward(grad)
    exact = grad[16:].double().t() @ x[16:].double()
    assert 1e-3 < _rel(w.grad[1], exact) < 0.06


@pytest.mark.parametrize("counts", [[16, 0, 32, 16], [5, 11, 0, 9], [1, 0, 0, 30]])
def test_padding_puts_every_expert_at_a_multiple_of_16(counts):
    counts_E = torch.tensor(counts)
    dest_R, ends_E, width = _padding(counts_E, sum(counts))
    starts = (ends_E - (counts_E + 15) // 16 * 16).tolist()
    assert all(s % 16 == 0 for s in starts) and width % 16 == 0 and int(ends_E[-1]) <= width
    expected = [start + j for start, n in zip(starts, counts) for j in range(n)]
    assert dest_R.tolist() == expected


def test_an_all_zero_row_stays_zero():
    x = torch.zeros(16, 32)
    x[1] = 1.0
    out = fp8_linear(x, torch.randn(16, 32))
    assert torch.isfinite(out).all() and out[0].abs().max() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 kernels need a CUDA GPU (Hopper or later)")
@pytest.mark.parametrize("counts", [[256, 0, 512, 256], [80, 176, 0, 144], [37, 91, 0, 128]],
                         ids=["aligned", "aligned-by-16", "ragged"])
def test_cuda_kernels_are_the_definition(counts):
    # bf16 outputs: the kernels sum the same fp8 values in fp32 and round once to bf16 (2^-9 relative)
    _check_linear("cuda", torch.bfloat16, 5e-3)
    _check_grouped("cuda", torch.bfloat16, counts, 5e-3)
