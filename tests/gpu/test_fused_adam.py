"""The Triton AdamW update against the eager fp32 arithmetic, and remainders against explicit masters."""

import pytest
import torch

from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam

pytestmark = pytest.mark.gpu

HYPER = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)


def params(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype).to(device))
            for s in [(1000, 3), (7, 64, 33), (4097,)]]


def run(optimizer, ps, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            p.main_grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.device)
        optimizer.step(grad_scale=0.5)


@pytest.mark.parametrize("master,moments", [("fp32", "fp32"), ("remainder", "bf16"), ("remainder", "fp32")])
def test_fused_kernel_matches_eager_cpu_math(master, moments):
    gpu, cpu = params(torch.bfloat16, "cuda"), params(torch.bfloat16, "cpu")
    fused = MixedPrecisionAdam(gpu, AdamConfig(master=master, moment_dtype=moments, **HYPER))
    eager = MixedPrecisionAdam(cpu, AdamConfig(master=master, moment_dtype=moments, **HYPER))
    run(fused, gpu)
    run(eager, cpu)
    # one ulp of fp32 difference (GPU vs CPU sqrt/division) can flip a bf16 moment's rounding
    rtol, atol = (1e-6, 1e-7) if moments == "fp32" else (1e-4, 1e-5)
    for a, b in zip(fused.master_weights().values(), eager.master_weights().values()):
        torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=atol)


def test_fused_remainders_equal_explicit_masters_bitwise():
    a, b = params(torch.bfloat16, "cuda"), params(torch.bfloat16, "cuda")
    with_remainders = MixedPrecisionAdam(a, AdamConfig(master="remainder", **HYPER))
    with_masters = MixedPrecisionAdam(b, AdamConfig(master="fp32", **HYPER))
    run(with_remainders, a)
    run(with_masters, b)
    for x, y in zip(with_remainders.master_weights().values(), with_masters.master_weights().values()):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))


def test_offloaded_state_updates_on_the_cpu_with_overlap():
    a, b = params(torch.bfloat16, "cuda"), params(torch.bfloat16, "cuda")
    on_gpu = MixedPrecisionAdam(a, AdamConfig(master="remainder", moment_dtype="bf16", **HYPER))
    offloaded = MixedPrecisionAdam(b, AdamConfig(master="remainder", moment_dtype="bf16", offload_fraction=0.5,
                                                 overlap=True, offload_update="host", **HYPER))
    assert any(s["exp_avg"].device.type == "cpu" for s in offloaded.state.values())
    run(on_gpu, a)
    run(offloaded, b)
    for x, y in zip(on_gpu.master_weights().values(), offloaded.master_weights().values()):
        torch.testing.assert_close(x.cpu(), y.cpu(), rtol=1e-4, atol=1e-5)  # bf16 moments, CPU vs GPU math


@pytest.mark.parametrize("master,moments", [("remainder", "bf16"), ("fp32", "fp32")])
def test_offloaded_state_streamed_through_the_gpu_is_bitwise_the_on_gpu_update(master, moments):
    from openrecipes.optim.offload_stream import StreamedStateUpdate

    def mixed(seed):  # an fp32 parameter among bf16 ones, as Muse Spark's router
        ps = params(torch.bfloat16, "cuda", seed)
        g = torch.Generator().manual_seed(seed + 7)
        return ps + [torch.nn.Parameter(torch.randn(3001, generator=g).cuda())]

    a, b = mixed(0), mixed(0)
    on_gpu = MixedPrecisionAdam(a, AdamConfig(master=master, moment_dtype=moments, **HYPER))
    streamed = MixedPrecisionAdam(b, AdamConfig(master=master, moment_dtype=moments, offload_fraction=1.0,
                                                offload_update="device", **HYPER))
    streamed._streamed = StreamedStateUpdate(chunk_elements=1000, slots=2)  # many chunks, slots reused
    assert all(s["exp_avg"].device.type == "cpu" and s["exp_avg"].is_pinned() for s in streamed.state.values())
    run(on_gpu, a)
    run(streamed, b)
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach())
    for x, y in zip(on_gpu.master_weights().values(), streamed.master_weights().values()):
        assert torch.equal(x.cpu().view(torch.int32), y.cpu().view(torch.int32))
    for p, q in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(on_gpu.state[p][key].cpu(), streamed.state[q][key])


@pytest.mark.parametrize("offload", [dict(), dict(offload_fraction=1.0, offload_update="device"),
                                     dict(offload_fraction=0.5, offload_update="host")])
def test_a_step_the_device_skips_changes_nothing_and_is_not_counted(offload):
    """The clip factor and the skip of a non-finite step are device tensors the kernel reads (the host does not wait
    for the norm): a skipped step leaves parameters and state bitwise, and a step after it is a first step."""
    a, b = params(torch.bfloat16, "cuda"), params(torch.bfloat16, "cuda")
    skipping = MixedPrecisionAdam(a, AdamConfig(master="remainder", **offload, **HYPER))
    plain = MixedPrecisionAdam(b, AdamConfig(master="remainder", **offload, **HYPER))
    for p in a:
        p.main_grad = torch.full(p.shape, float("nan"), device="cuda")
    before = [p.detach().clone() for p in a]
    skipping.step(grad_scale=torch.tensor(0.5, device="cuda"), skip=torch.tensor(True, device="cuda"))
    skipping.forget_skipped_step()
    assert all(torch.equal(x, y.detach()) for x, y in zip(before, a))
    assert all(int(s["step"]) == 0 for s in skipping.state.values())
    g = torch.Generator().manual_seed(1)
    for p, q in zip(a, b):
        p.main_grad = (torch.randn(p.shape, generator=g) * 0.1).cuda()
        q.main_grad = p.main_grad.clone()
    skipping.step(grad_scale=torch.tensor(0.5, device="cuda"), skip=torch.tensor(False, device="cuda"))
    plain.step(grad_scale=0.5)
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach())
