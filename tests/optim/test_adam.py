"""Mixed-precision Adam: parity with torch AdamW, bitwise remainders, offload, bytes per parameter."""

import pytest
import torch

from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam, bytes_per_param
from openrecipes.optim.remainders import join_master, split_master
from openrecipes.optim.schedule import lr_at

HYPER = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)


def make_params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (4, 8, 8), (32, 8), (8, 16)]
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def grads_sequence(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) * 0.1 for p in params] for _ in range(steps)]


def run(optimizer, params, grads, *, main_grad):
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            if main_grad:
                p.main_grad = grad.float().clone()
            else:
                p.grad = grad.to(p.dtype).clone()
        optimizer.step()


def test_fp32_matches_torch_adamw_bitwise():
    ours, theirs = make_params(torch.float32), make_params(torch.float32)
    grads = grads_sequence(ours, 3)
    run(MixedPrecisionAdam(ours, AdamConfig(master="param", **HYPER)), ours, grads, main_grad=False)
    run(torch.optim.AdamW(theirs, foreach=False, fused=False, **HYPER), theirs, grads, main_grad=False)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_remainders_rebuild_the_explicit_fp32_masters_bitwise(moment_dtype):
    remainder_params, explicit_params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    grads = grads_sequence(remainder_params, 3)
    with_remainders = MixedPrecisionAdam(remainder_params, AdamConfig(master="remainder", moment_dtype=moment_dtype,
                                                                      **HYPER))
    with_masters = MixedPrecisionAdam(explicit_params, AdamConfig(master="fp32", moment_dtype=moment_dtype, **HYPER))
    run(with_remainders, remainder_params, grads, main_grad=True)
    run(with_masters, explicit_params, grads, main_grad=True)
    rebuilt, explicit = with_remainders.master_weights(), with_masters.master_weights()
    for a, b in zip(remainder_params, explicit_params):
        assert torch.equal(rebuilt[a].view(torch.int32), explicit[b].view(torch.int32))
        assert not torch.equal(rebuilt[a], a.float())  # the remainder carries real information


def test_split_and_join_are_exact_and_round_to_nearest():
    values = torch.cat([torch.randn(10_000) * 10 ** torch.randint(-6, 6, (10_000,)).float(),
                        torch.tensor([0.0, -0.0, 1.0, -1.0, 1.00390625, -1.00390625])])
    param, remainder = split_master(values)
    assert torch.equal(join_master(param, remainder).view(torch.int32), values.view(torch.int32))
    # nearest bf16: no other bf16 value is closer to the master
    error = (param.float() - values).abs()
    assert torch.all(error <= (values.to(torch.bfloat16).float() - values).abs())


def test_offload_fraction_moves_whole_parameters_in_order_and_changes_nothing():
    params, offloaded_params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    grads = grads_sequence(params, 3)
    plain = MixedPrecisionAdam(params, AdamConfig(master="remainder", moment_dtype="bf16", **HYPER))
    offloaded = MixedPrecisionAdam(offloaded_params, AdamConfig(master="remainder", moment_dtype="bf16",
                                                                offload_fraction=0.3, **HYPER))
    sizes = [p.numel() for p in offloaded_params]
    # first parameter holds 128 of 928 elements (13.8 %), the first two 640 (69 %): both are needed for 30 %
    assert offloaded.offloaded_fraction() == pytest.approx(sum(sizes[:2]) / sum(sizes))
    run(plain, params, grads, main_grad=True)
    run(offloaded, offloaded_params, grads, main_grad=True)
    for a, b in zip(params, offloaded_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("master,moments,param_dtype", [
    ("param", "fp32", torch.float32), ("fp32", "fp32", torch.bfloat16),
    ("remainder", "fp32", torch.bfloat16), ("remainder", "bf16", torch.bfloat16)])
def test_bytes_per_parameter_are_what_the_state_holds(master, moments, param_dtype):
    params = make_params(param_dtype)
    optimizer = MixedPrecisionAdam(params, AdamConfig(master=master, moment_dtype=moments, **HYPER))
    elements = sum(p.numel() for p in params)
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
                      if k != "step")
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = 4 * elements  # fp32 gradients (fp32 params) or fp32 accumulators (bf16 params)
    name = "fp32" if param_dtype == torch.float32 else "bf16"
    expected = bytes_per_param(param_dtype=name, master=master, moment_dtype=moments)
    assert (state_bytes + param_bytes + grad_bytes) == expected * elements
    assert expected == {"param": 16, "fp32": 18, "remainder": 16 if moments == "fp32" else 12}[master]


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="optimizer.master"):
        AdamConfig(master="fp16")
    with pytest.raises(ValueError, match="offload.fraction"):
        AdamConfig(offload_fraction=1.5)
    with pytest.raises(ValueError, match="needs fp32 parameters"):
        MixedPrecisionAdam(make_params(torch.bfloat16), AdamConfig(master="param"))
    with pytest.raises(ValueError, match="not supported"):
        MixedPrecisionAdam(make_params(torch.float16), AdamConfig(master="remainder"))


def test_fp32_parameters_in_a_bf16_model_are_their_own_masters():
    mixed = make_params(torch.bfloat16)[:2] + make_params(torch.float32)[2:]
    optimizer = MixedPrecisionAdam(mixed, AdamConfig(master="remainder", moment_dtype="bf16", **HYPER))
    assert "remainder" in optimizer.state[mixed[0]] and "remainder" not in optimizer.state[mixed[3]]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in mixed[2:]]
    grads = grads_sequence(mixed, 2)
    run(optimizer, mixed, grads, main_grad=False)
    run(MixedPrecisionAdam(reference, AdamConfig(master="param", moment_dtype="bf16", **HYPER)), reference,
        [g[2:] for g in grads], main_grad=False)
    for a, b in zip(mixed[2:], reference):
        assert torch.equal(a, b) and a.dtype == torch.float32


def test_schedule_warms_up_then_decays_to_min():
    kwargs = dict(total_steps=20, lr=1e-5, min_lr=1e-6, warmup_fraction=0.1)
    assert lr_at(0, **kwargs) == pytest.approx(5e-6)
    assert lr_at(1, **kwargs) == pytest.approx(1e-5)
    assert lr_at(2, **kwargs) == pytest.approx(1e-5)
    assert lr_at(19, **kwargs) > 1e-6 and lr_at(20, **kwargs) == pytest.approx(1e-6)
    values = [lr_at(s, **kwargs) for s in range(2, 21)]
    assert values == sorted(values, reverse=True)


def _snapshot(optimizer, params):
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    return [p.detach().clone() for p in params], state


@pytest.mark.parametrize("offload", [0.0, 0.5])
def test_a_scale_and_skip_given_as_tensors_act_as_the_host_values(offload):
    """The loop hands the clip factor and the non-finite skip as scalar tensors; a skipped step changes no
    parameter, no moment and no step count, and the steps around it are bitwise those of a run without it."""
    config = AdamConfig(master="remainder", offload_fraction=offload, offload_update="host", **HYPER)
    ours, reference = make_params(torch.bfloat16), make_params(torch.bfloat16)
    with_tensors, with_floats = MixedPrecisionAdam(ours, config), MixedPrecisionAdam(reference, config)
    grads = grads_sequence(ours, 3)
    for index, step_grads in enumerate(grads):
        for p, q, grad in zip(ours, reference, step_grads):
            p.main_grad, q.main_grad = grad.float().clone(), grad.float().clone()
        if index == 1:  # a step the device found non-finite: garbage gradients, nothing may change
            for p in ours:
                p.main_grad = torch.full_like(p.main_grad, float("nan"))
            before = _snapshot(with_tensors, ours)
            with_tensors.step(grad_scale=torch.tensor(0.25), skip=torch.tensor(True))
            with_tensors.forget_skipped_step()
            after = _snapshot(with_tensors, ours)
            assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
            assert all(torch.equal(before[1][k][key], after[1][k][key]) for k in before[1] for key in before[1][k])
            for p, grad in zip(ours, step_grads):
                p.main_grad = grad.float().clone()
        with_tensors.step(grad_scale=torch.tensor(0.5), skip=torch.tensor(False))
        with_floats.step(grad_scale=0.5)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)
    assert [int(with_tensors.state[p]["step"]) for p in ours] == [3] * len(ours)
