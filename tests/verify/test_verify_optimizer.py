"""Optimizer component test: the CPU default passes, each negative control fails, a broken candidate is caught."""

import json

import pytest
import torch

import openrecipes.optim.adam as adam_module
from openrecipes import cli
from openrecipes.verify.optimizer import (CPU_SHAPE, Hyper, ReferenceAdam, run_component_test, standard_arms)


@pytest.fixture(scope="module")
def default_report():
    return run_component_test(shape=CPU_SHAPE)


def test_cpu_default_passes_with_margin(default_report):
    assert default_report.passed
    bounds = default_report.bounds
    for arm in default_report.arms:
        for step in (1, 3):
            if arm.role == "candidate":
                assert arm.errors[step] < 0.5 * bounds[step], (arm.name, step)
    # the reference and the arms did move: a zero error everywhere would also "pass"
    assert all(a.errors[3] > 0 for a in default_report.arms)


@pytest.mark.parametrize("control", ["bf16 masters", "wrong beta2", "no bias correction"])
def test_each_control_fails_the_bound(default_report, control):
    arm = next(a for a in default_report.arms if control in a.name)
    assert arm.role == "control" and arm.ok
    worst_ratio = max(arm.errors[s] / default_report.bounds[s] for s in (1, 3))
    assert worst_ratio > 1.5, (arm.name, arm.errors, default_report.bounds)


def test_candidates_cover_offload_fractions_and_overlap():
    names = [a.name for a in standard_arms(Hyper()) if a.role == "candidate"]
    for moments in ("bf16", "fp32"):
        for fraction in ("1", "0.5", "0.3"):
            for mode in ("overlapped", "serial"):
                assert f"remainder, {moments} moments, offload {fraction}, {mode}" in names


def test_reference_adam_matches_torch_adamw_in_fp64():
    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(6, 5, generator=g, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hyper = Hyper(lr=1e-2)
    reference = ReferenceAdam(ours, hyper)
    # torch applies weight decay to every tensor; the reference (like the optimizer under test) only to 2-D ones
    torch_adam = torch.optim.AdamW([{"params": [theirs[0]], "weight_decay": hyper.weight_decay},
                                    {"params": [theirs[1]], "weight_decay": 0.0}], lr=hyper.lr,
                                   betas=hyper.betas, eps=hyper.eps)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ours]
        for p, q, grad in zip(ours, theirs, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        reference.step()
        torch_adam.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def _run_cli(capsys, *extra):
    status = cli.main(["verify", "optimizer", "--json", *extra])
    return status, json.loads(capsys.readouterr().out)


def test_json_fields_and_exit_status(capsys):
    status, out = _run_cli(capsys)
    assert status == 0 and out["passed"] is True
    for key in ("summary", "device", "shape", "hyperparameters", "steps", "bounds", "arms", "self_tests"):
        assert key in out
    assert out["shape"]["ep"] == 1 and out["steps"] == [1, 3]
    arm = out["arms"][0]
    assert set(arm) >= {"name", "role", "offload_fraction", "ok", "errors", "worst_tensor", "worst_kind"}
    assert arm["worst_kind"]["1"] in ("dense", "expert")
    assert "negative controls fail" in out["summary"] and "bitwise identical" in out["summary"]


def test_corrupted_remainders_fail(capsys, monkeypatch):
    real_split = adam_module.split_master

    def drop_remainder(master):
        param, remainder = real_split(master)
        return param, torch.zeros_like(remainder)

    monkeypatch.setattr(adam_module, "split_master", drop_remainder)
    status, out = _run_cli(capsys)
    assert status == 1
    assert not any(t["bitwise_equal"] for t in out["self_tests"])
    assert any(a["role"] == "candidate" and not a["ok"] for a in out["arms"])


def test_candidate_without_bias_correction_fails(capsys, monkeypatch):
    real_math = adam_module.adam_math
    # only the remainder arms are broken: the default arm (explicit fp32 masters) keeps the real formula
    broken_ids: set[int] = set()

    def maybe_broken(master, grad, exp_avg, exp_avg_sq, *, step, **kwargs):
        if id(master) in broken_ids:
            # without bias correction: the step-1 update is (1 - beta1) / sqrt(1 - beta2) times too small
            exp_avg.lerp_(grad, 1.0 - kwargs["beta1"])
            exp_avg_sq.mul_(kwargs["beta2"]).addcmul_(grad, grad, value=1.0 - kwargs["beta2"])
            master.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(kwargs["eps"]), value=-kwargs["lr"])
            return
        real_math(master, grad, exp_avg, exp_avg_sq, step=step, **kwargs)

    real_join = adam_module.join_master

    def join_and_mark(param, remainder):
        master = real_join(param, remainder)
        broken_ids.add(id(master))
        return master

    monkeypatch.setattr(adam_module, "adam_math", maybe_broken)
    monkeypatch.setattr(adam_module, "join_master", join_and_mark)
    status, out = _run_cli(capsys, "--steps", "1")
    assert status == 1
    remainder_arms = [a for a in out["arms"] if a["name"].startswith("remainder")]
    assert remainder_arms and not any(a["ok"] for a in remainder_arms)
    assert next(a for a in out["arms"] if a["role"] == "default")["ok"]


def test_bad_shape_is_a_user_error(capsys):
    assert cli.main(["verify", "optimizer", "--top-k", "9"]) == 2
    assert "--top-k" in capsys.readouterr().err
