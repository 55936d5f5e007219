"""Optimizer component test: one MoE layer, each optimizer arm against an FP64 Adam reference.

The layer is RMSNorm -> dense projection -> SparseMoeBlock (router + grouped SwiGLU experts), with a residual;
the loss of step k is a weighted mean squared distance to a fixed target on the k-th input of a fixed, seeded
sequence. The initial weights are drawn once and rounded to bf16, so every arm, the fp64 reference included,
starts from exactly the same values.

Every arm runs its own forward and backward on its own current parameters, so it follows its own trajectory.
Where that forward runs is ``compute`` (see COMPUTE_MODES): in fp64 from the bf16 values (the default: the error
is the optimizer's own) or in bf16 as in training (the bf16 gradient noise then dominates every arm's error,
the bound grows with it, and the controls stop failing; docs/verify.md gives the numbers). The remainder
self-test is different: both optimizers get the very same gradient tensors, so their FP32 masters can be
compared bit for bit.

Metric: for each tensor, ||theta - theta_ref|| / ||theta_ref|| between the arm's fp32 masters and the fp64
reference parameters; an arm's error is its worst tensor's. Bound at step s = 2 x the default optimizer's error at
s + 1e-3 (default: explicit fp32 masters, fp32 moments, on the device). A candidate passes when its error is within
the bound after every checked step; a negative control fails (as it must) when it is over the bound after any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from openrecipes.models.common.moe import SparseMoeBlock
from openrecipes.optim.adam import AdamConfig, MixedPrecisionAdam

BOUND_FLOOR = 1e-3
# Where the mixed-precision arms run their forward and backward: "bf16" on their bf16 parameters (the gradient
# carries bf16 rounding, as in training), or "fp64" on an fp64 copy of their current bf16 values (the error is
# then the optimizer's own: its state precision and the bf16 parameter storage, over the arm's own trajectory).
COMPUTE_MODES = ("fp64", "bf16")


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    hidden: int
    experts: int
    top_k: int
    ffn: int
    tokens: int

    def __post_init__(self) -> None:
        for name in ("hidden", "experts", "top_k", "ffn", "tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k {self.top_k} exceeds --experts {self.experts}")


# A few seconds on two CPU cores.
CPU_SHAPE = LayerShape(hidden=64, experts=8, top_k=2, ffn=32, tokens=128)
# The seed card's layer shape, except the expert count: one rank of its EP 8 holds 64 of the 512 experts. The full
# 512-expert layer (6.4e9 expert weights) needs ~130 GB of optimizer state for a single bf16 arm and ~200 GB for
# the fp64 reference, more than one GPU holds; pass --experts 512 on a device that can.
CUDA_SHAPE = LayerShape(hidden=4096, experts=64, top_k=10, ffn=1024, tokens=4096)


@dataclass(frozen=True, kw_only=True)
class Hyper:
    """Defaults: the seed recipe's betas, eps and weight decay; the lr is large enough that the negative controls
    move the weights measurably further than the 1e-3 floor of the bound (see docs/verify.md)."""

    lr: float = 1.8e-3
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.1


class MoeLayer(nn.Module):
    """RMSNorm + dense projection + MoE block, with a residual around the projection output."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(shape.hidden))
        self.dense = nn.Parameter(torch.empty(shape.hidden, shape.hidden))
        self.moe = SparseMoeBlock(hidden_size=shape.hidden, num_experts=shape.experts, top_k=shape.top_k,
                                  ffn_size=shape.ffn, normalize_top_k=True)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        x32 = x_TD.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x_TD.dtype) * self.norm
        h_TD = F.linear(normed, self.dense)
        return h_TD + self.moe(h_TD)


def tensor_kind(name: str) -> str:
    return "expert" if ".experts." in name else "dense"


def initial_state(shape: LayerShape, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights, rounded to bf16 and held in fp64 (exactly representable in every arm)."""
    generator = torch.Generator().manual_seed(seed)
    layer = MoeLayer(shape)
    state = {}
    for name, param in layer.named_parameters():
        if name == "norm":
            value = torch.ones(param.shape)
        else:
            fan_in = param.shape[-1]
            value = torch.randn(param.shape, generator=generator) * (1.0 / math.sqrt(fan_in))
        state[name] = value.to(torch.bfloat16).double()
    return state


# Loss weight of step k (cycled): the gradient shrinks between steps, as it does while a loss falls; a wrong
# beta2 shows only when the second moment has something to average (with a constant gradient scale Adam's
# bias-corrected update does not depend on beta2 at all).
LOSS_WEIGHTS = (1.0, 0.25, 0.1)


def step_inputs(shape: LayerShape, steps: int, seed: int) -> list[torch.Tensor]:
    """Per-step inputs: a shared base plus fresh noise, so gradients differ between steps but mostly keep their
    sign (updates lost to bf16 rounding then add up instead of cancelling)."""
    generator = torch.Generator().manual_seed(seed + 1)
    base = torch.randn(shape.tokens, shape.hidden, generator=generator, dtype=torch.float64)
    return [(base + INPUT_NOISE * torch.randn(shape.tokens, shape.hidden, generator=generator,
                                              dtype=torch.float64)).to(torch.bfloat16).double() for _ in range(steps)]


INPUT_NOISE = 0.25
# Loss: mean squared distance to TARGET_SCALE x (the input rotated by one feature). A target much larger than
# the output keeps the gradient's sign stable under the bf16 rounding of the parameters, so the default arm's
# error (hence the bound) reflects the optimizer and not a loss surface that flips sign at every rounding.
TARGET_SCALE = 3.0


def build_layer(shape: LayerShape, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> MoeLayer:
    layer = MoeLayer(shape).to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(state[name])
    return layer


def forward_backward(layer: MoeLayer, x_TD: torch.Tensor, shadow: MoeLayer | None = None, *,
                     weight: float = 1.0) -> None:
    """Fill ``param.grad`` of an fp64 layer, or ``param.main_grad`` (fp32) of a bf16 one.

    With ``shadow`` (an fp64 layer) the bf16 layer's current values are copied into it and the forward and
    backward run there: the gradient then differs from the reference's only through the parameter values."""
    for param in layer.parameters():
        param.grad = None
    if shadow is not None:
        with torch.no_grad():
            for mine, theirs in zip(shadow.parameters(), layer.parameters()):
                mine.copy_(theirs)
        forward_backward(shadow, x_TD.double(), weight=weight)
        for mine, theirs in zip(layer.parameters(), shadow.parameters()):
            mine.main_grad = theirs.grad.float()
        return
    out = layer(x_TD.to(next(layer.parameters()).dtype))
    wide = out.to(torch.float64 if out.dtype == torch.float64 else torch.float32)
    (weight * (wide - TARGET_SCALE * x_TD.to(wide.dtype).roll(1, dims=-1)).pow(2).mean()).backward()
    if out.dtype == torch.bfloat16:
        for param in layer.parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            param.main_grad, param.grad = grad.float(), None


def _weight(step: int) -> float:
    return LOSS_WEIGHTS[(step - 1) % len(LOSS_WEIGHTS)]


class ReferenceAdam:
    """AdamW in fp64, written from the textbook formulas (not shared with the optimizer under test)."""

    def __init__(self, params: list[nn.Parameter], hyper: Hyper) -> None:
        self.params, self.hyper, self.t = params, hyper, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        h, self.t = self.hyper, self.t + 1
        beta1, beta2 = h.betas
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            m.copy_(beta1 * m + (1 - beta1) * g)
            v.copy_(beta2 * v + (1 - beta2) * g * g)
            m_hat, v_hat = m / (1 - beta1 ** self.t), v / (1 - beta2 ** self.t)
            decay = h.weight_decay if p.dim() >= 2 else 0.0
            p.copy_(p * (1 - h.lr * decay) - h.lr * m_hat / (v_hat.sqrt() + h.eps))


class ControlAdam:
    """A deliberately wrong AdamW for the negative controls: fp32 math on fp32 moments, and either
    ``bf16_master`` (the bf16 parameter is its own master: each update is rounded into it, no remainder kept) or
    no bias correction (with explicit fp32 masters)."""

    def __init__(self, params: list[nn.Parameter], hyper: Hyper, *, bf16_master: bool, bias_correction: bool) -> None:
        self.params, self.hyper, self.t = params, hyper, 0
        self.bf16_master, self.bias_correction = bf16_master, bias_correction
        self.masters = [None if bf16_master else p.detach().float().clone() for p in params]
        self.m = [torch.zeros(p.shape, device=p.device) for p in params]
        self.v = [torch.zeros(p.shape, device=p.device) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        h, self.t = self.hyper, self.t + 1
        beta1, beta2 = h.betas
        c1 = 1 - beta1 ** self.t if self.bias_correction else 1.0
        c2 = 1 - beta2 ** self.t if self.bias_correction else 1.0
        for i, p in enumerate(self.params):
            g = p.main_grad
            master = p.float() if self.bf16_master else self.masters[i]
            self.m[i].mul_(beta1).add_(g, alpha=1 - beta1)
            self.v[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if p.dim() >= 2:
                master.mul_(1 - h.lr * h.weight_decay)
            master.sub_(h.lr * (self.m[i] / c1) / ((self.v[i] / c2).sqrt() + h.eps))
            p.copy_(master)

    def master_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        return {p: (p.float() if self.bf16_master else m.clone()) for p, m in zip(self.params, self.masters)}


@dataclass(frozen=True, kw_only=True)
class Arm:
    name: str
    role: str  # "default" (defines the bound), "candidate" (must pass) or "control" (must fail)
    make: Callable[[list[nn.Parameter]], object]
    offload_fraction: float = 0.0


def standard_arms(hyper: Hyper) -> list[Arm]:
    def mpa(**kwargs) -> Callable[[list[nn.Parameter]], object]:
        config = AdamConfig(lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay,
                            **kwargs)
        return lambda params: MixedPrecisionAdam(params, config)

    arms = [Arm(name="default: fp32 masters, fp32 moments", role="default", make=mpa(master="fp32"))]
    for moments in ("bf16", "fp32"):
        arms.append(Arm(name=f"remainder, {moments} moments", role="candidate",
                        make=mpa(master="remainder", moment_dtype=moments)))
        for fraction in (1.0, 0.5, 0.3):
            for overlap in (True, False):
                arms.append(Arm(name=f"remainder, {moments} moments, offload {fraction:g}"
                                     f"{', overlapped' if overlap else ', serial'}", role="candidate",
                                make=mpa(master="remainder", moment_dtype=moments, offload_fraction=fraction,
                                         overlap=overlap), offload_fraction=fraction))
    arms.append(Arm(name="control: bf16 masters, no remainders", role="control",
                    make=lambda ps: ControlAdam(ps, hyper, bf16_master=True, bias_correction=True)))
    arms.append(Arm(name=f"control: wrong beta2 {WRONG_BETA2} (not {hyper.betas[1]})", role="control",
                    make=_wrong_beta2(hyper)))
    arms.append(Arm(name="control: no bias correction", role="control",
                    make=lambda ps: ControlAdam(ps, hyper, bf16_master=False, bias_correction=False)))
    return arms


WRONG_BETA2 = 0.5


def _wrong_beta2(hyper: Hyper) -> Callable[[list[nn.Parameter]], object]:
    config = AdamConfig(lr=hyper.lr, betas=(hyper.betas[0], WRONG_BETA2), eps=hyper.eps,
                        weight_decay=hyper.weight_decay, master="fp32")
    return lambda params: MixedPrecisionAdam(params, config)


@dataclass(kw_only=True)
class ArmResult:
    name: str
    role: str
    offload_fraction: float
    errors: dict[int, float] = field(default_factory=dict)  # step -> worst tensor's relative L2 error
    worst: dict[int, str] = field(default_factory=dict)  # step -> name of that tensor
    within_bound: dict[int, bool] = field(default_factory=dict)
    ok: bool = False  # candidate/default: within every bound; control: over the bound at some step


def relative_errors(masters: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for name, ref in reference.items():
        diff = (masters[name].to(ref.device, torch.float64) - ref).norm().item()
        out[name] = diff / max(ref.norm().item(), 1e-300)
    return out


def _masters_by_name(layer: MoeLayer, optimizer) -> dict[str, torch.Tensor]:
    weights = optimizer.master_weights()
    return {name: weights[param] for name, param in layer.named_parameters()}


def run_reference(shape: LayerShape, state, inputs, hyper: Hyper, checkpoints: list[int],
                  device: str) -> dict[int, dict[str, torch.Tensor]]:
    layer = build_layer(shape, state, torch.float64, device)
    optimizer = ReferenceAdam(list(layer.parameters()), hyper)
    snapshots = {}
    for step in range(1, max(checkpoints) + 1):
        forward_backward(layer, inputs[step - 1].to(device), weight=_weight(step))
        optimizer.step()
        if step in checkpoints:
            snapshots[step] = {n: p.detach().clone() for n, p in layer.named_parameters()}
    return snapshots


def _shadow(shape: LayerShape, state, device: str, compute: str) -> MoeLayer | None:
    if compute not in COMPUTE_MODES:
        raise ValueError(f"--compute {compute!r} is not one of {COMPUTE_MODES}")
    return build_layer(shape, state, torch.float64, device) if compute == "fp64" else None


def run_arm(arm: Arm, shape: LayerShape, state, inputs, reference, checkpoints: list[int],
            device: str, compute: str = "bf16") -> ArmResult:
    layer = build_layer(shape, state, torch.bfloat16, device)
    shadow = _shadow(shape, state, device, compute)
    optimizer = arm.make(list(layer.parameters()))
    result = ArmResult(name=arm.name, role=arm.role, offload_fraction=arm.offload_fraction)
    for step in range(1, max(checkpoints) + 1):
        forward_backward(layer, inputs[step - 1].to(device), shadow, weight=_weight(step))
        optimizer.step()
        if step in checkpoints:
            errors = relative_errors(_masters_by_name(layer, optimizer), reference[step])
            worst = max(errors, key=errors.get)
            result.errors[step], result.worst[step] = errors[worst], worst
    return result


def remainder_self_test(shape: LayerShape, state, inputs, hyper: Hyper, checkpoints: list[int], device: str,
                        moment_dtype: str, compute: str = "bf16") -> dict:
    """Remainder masters vs explicit fp32 masters, both fed the same gradient tensors each step."""
    common = dict(lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay,
                  moment_dtype=moment_dtype)
    explicit_layer = build_layer(shape, state, torch.bfloat16, device)
    remainder_layer = build_layer(shape, state, torch.bfloat16, device)
    explicit = MixedPrecisionAdam(list(explicit_layer.parameters()), AdamConfig(master="fp32", **common))
    remainder = MixedPrecisionAdam(list(remainder_layer.parameters()), AdamConfig(master="remainder", **common))
    shadow = _shadow(shape, state, device, compute)
    mismatched: dict[int, list[str]] = {}
    for step in range(1, max(checkpoints) + 1):
        forward_backward(explicit_layer, inputs[step - 1].to(device), shadow, weight=_weight(step))
        for (_, a), (_, b) in zip(explicit_layer.named_parameters(), remainder_layer.named_parameters()):
            b.main_grad = a.main_grad.clone()
        explicit.step()
        remainder.step()
        if step in checkpoints:
            ours, theirs = _masters_by_name(remainder_layer, remainder), _masters_by_name(explicit_layer, explicit)
            mismatched[step] = [n for n in ours if not torch.equal(ours[n].view(torch.int32),
                                                                     theirs[n].view(torch.int32))]
    return {"moment_dtype": moment_dtype, "bitwise_equal": not any(mismatched.values()),
            "mismatched_tensors": {str(s): names for s, names in mismatched.items()}}


@dataclass(kw_only=True)
class ComponentReport:
    device: str
    compute: str
    shape: LayerShape
    hyper: Hyper
    checkpoints: list[int]
    bounds: dict[int, float]
    arms: list[ArmResult]
    self_tests: list[dict]
    passed: bool = False


def run_component_test(*, shape: LayerShape, hyper: Hyper = Hyper(), checkpoints: tuple[int, ...] = (1, 3),
                       device: str = "cpu", seed: int = 0, compute: str = "fp64",
                       arms: list[Arm] | None = None) -> ComponentReport:
    steps = sorted(set(checkpoints))
    if not steps or steps[0] < 1:
        raise ValueError(f"--steps must be positive step numbers, got {list(checkpoints)}")
    arms = standard_arms(hyper) if arms is None else arms
    if [a.role for a in arms].count("default") != 1:
        raise ValueError("the component test needs exactly one default arm (it defines the bound)")
    state = initial_state(shape, seed)
    inputs = step_inputs(shape, steps[-1], seed)
    reference = run_reference(shape, state, inputs, hyper, steps, device)
    results = []
    for arm in arms:
        results.append(run_arm(arm, shape, state, inputs, reference, steps, device, compute))
        if device == "cuda":
            torch.cuda.empty_cache()
    default = next(r for r in results if r.role == "default")
    bounds = {s: 2.0 * default.errors[s] + BOUND_FLOOR for s in steps}
    for r in results:
        r.within_bound = {s: r.errors[s] <= bounds[s] for s in steps}
        inside = all(r.within_bound.values())
        r.ok = (not inside) if r.role == "control" else inside
    self_tests = [remainder_self_test(shape, state, inputs, hyper, steps, device, m, compute)
                  for m in ("bf16", "fp32")]
    report = ComponentReport(device=device, compute=compute, shape=shape, hyper=hyper, checkpoints=steps, bounds=bounds,
                             arms=results, self_tests=self_tests)
    report.passed = all(r.ok for r in results) and all(t["bitwise_equal"] for t in self_tests)
    return report
