"""Adam with decoupled weight decay, in three precisions, with optional CPU offload of optimizer state.

``master``:
- ``param``: the parameters are the fp32 masters (fp32 training).
- ``fp32``: bf16 parameters plus an explicit fp32 master copy (the usual mixed-precision optimizer).
- ``remainder``: bf16 parameters plus an int16 remainder; together they are the fp32 master, bitwise
  (``remainders.py``). Saves 2 bytes per parameter against ``fp32``.
``moment_dtype``: fp32 or bf16 storage for both moments. All arithmetic is fp32 whatever is stored.

Gradients are read from ``param.main_grad`` (an fp32 accumulation buffer the training loop keeps for bf16
parameters) when present, else ``param.grad``. Weight decay applies to tensors of two or more dimensions.

Offload: whole parameters, in order, have their optimizer state on (pinned) CPU memory until they hold
``offload_fraction`` of all elements. ``offload_update``: ``device`` streams that state through the GPU in chunks
during the step and updates it there with the same kernel as the rest (``offload_stream.py``); ``host`` runs the
update on the CPU: with ``overlap`` on CUDA, gradient copies to the host run on a side stream while the on-GPU
parameters update, and each updated parameter is copied back as soon as it is ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from openrecipes.parallel.dtensor import is_sharded, shard_like
from openrecipes.parallel.dtensor import local_tensor as _local
from openrecipes.optim import fused_cuda
from openrecipes.optim.offload_stream import StreamedStateUpdate
from openrecipes.optim.pinned import pinned_zeros
from openrecipes.optim.remainders import join_master, split_master

MASTER_MODES = ("param", "fp32", "remainder")
OFFLOAD_UPDATES = ("device", "host")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class AdamConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    master: str = "fp32"
    moment_dtype: str = "fp32"
    offload_fraction: float = 0.0
    overlap: bool = True
    offload_update: str = "device"   # where offloaded state is updated: streamed through the GPU, or on the host

    def __post_init__(self) -> None:
        if self.master not in MASTER_MODES:
            raise ValueError(f"optimizer.master: {self.master!r} is not one of {MASTER_MODES}")
        if self.moment_dtype not in _DTYPES:
            raise ValueError(f"optimizer.moment_dtype: {self.moment_dtype!r} is not one of {tuple(_DTYPES)}")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(f"offload.fraction must be in [0, 1], got {self.offload_fraction}")
        if self.offload_update not in OFFLOAD_UPDATES:
            raise ValueError(f"offload.update: {self.offload_update!r} is not one of {OFFLOAD_UPDATES}")
        if not (0.0 <= self.betas[0] < 1.0 and 0.0 <= self.betas[1] < 1.0):
            raise ValueError(f"optimizer.betas must be in [0, 1), got {self.betas}")


def bytes_per_param(*, param_dtype: str, master: str, moment_dtype: str) -> int:
    """Device + host bytes one parameter costs: param, fp32 gradient accumulator (bf16 params), master, moments."""
    param = 4 if param_dtype == "fp32" else 2
    grad = 4
    master_bytes = {"param": 0, "fp32": 4, "remainder": 2}[master]
    moments = 2 * (4 if moment_dtype == "fp32" else 2)
    return param + grad + master_bytes + moments


def adam_math(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of fp32 tensors, in place, in the order torch.optim.AdamW uses."""
    if weight_decay:
        master.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


_CPU_CHUNK = 1 << 16  # elements per slice of a CPU update (about 1 MiB of fp32 temporaries per tensor)


class MixedPrecisionAdam(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.nn.Parameter], config: AdamConfig) -> None:
        defaults = dict(lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
        super().__init__(params, defaults)
        self.config = config
        all_params = [p for group in self.param_groups for p in group["params"]]
        if config.master == "param" and any(p.dtype != torch.float32 for p in all_params):
            raise ValueError("optimizer.master 'param' needs fp32 parameters; use 'fp32' or 'remainder' for bf16")
        # fp32 parameters in a bf16 model (Muse Spark's router and residual gates) are their own masters
        unsupported = {p.dtype for p in all_params} - {torch.bfloat16, torch.float32}
        if unsupported:
            raise ValueError(f"parameters of dtype {sorted(map(str, unsupported))} are not supported (bf16 or fp32)")
        self._offloaded = _choose_offloaded(all_params, config.offload_fraction)
        self._grad_scale: torch.Tensor | float = 1.0
        self._skip: torch.Tensor | None = None
        self._device_scales: dict[torch.device, torch.Tensor] = {}
        self._counted_on_device: list[torch.nn.Parameter] = []  # updates the device may have skipped (``skip``)
        self._host_reads: tuple[float, bool] | None = None
        self._streamed = StreamedStateUpdate()
        for p in all_params:
            self._init_state(p)

    def _init_state(self, p: torch.nn.Parameter) -> None:
        local = _local(p)
        device = torch.device("cpu") if p in self._offloaded else local.device
        pin = device.type == "cpu" and local.is_cuda
        moment = _DTYPES[self.config.moment_dtype]
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.int64)
        state["exp_avg"] = _zeros(local, moment, device, pin)
        state["exp_avg_sq"] = _zeros(local, moment, device, pin)
        master_mode = "param" if local.dtype == torch.float32 else self.config.master
        if master_mode == "fp32":
            state["master"] = _empty_like(local, torch.float32, device, pin).copy_(local)
        elif master_mode == "remainder":
            state["remainder"] = _zeros(local, torch.int16, device, pin)
        if p in self._offloaded and master_mode == "param":
            state["master"] = _empty_like(local, torch.float32, device, pin).copy_(local)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | float = 1.0,
             skip: torch.Tensor | None = None):  # noqa: D401 - torch.optim signature
        """``grad_scale`` multiplies every gradient as it is read (gradient clipping without an extra pass).

        Both may be scalar tensors on the device, computed there from the gradient norm: the GPU updates read them,
        so nothing here waits for the backward; only the host updates (CPU state, ``offload.update: host``) read
        them back. ``skip`` true leaves every parameter and its state as they were; a caller who learns afterwards
        that the device skipped calls ``forget_skipped_step`` so that the step is not counted either."""
        if closure is not None:
            raise ValueError("MixedPrecisionAdam does not take a closure")
        self._grad_scale, self._skip = grad_scale, skip
        self._device_scales, self._counted_on_device, self._host_reads = {}, [], None
        on_device, offloaded = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if _grad(p) is None:
                    continue
                (offloaded if p in self._offloaded else on_device).append((p, group))
        if offloaded and self.config.offload_update == "device" and fused_cuda.available(_local(offloaded[0][0])):
            for p, group in on_device:
                self._update(p, group, _grad(p))
            self._update_streamed(offloaded)
            return None
        copy_stream = None
        host_grads = {}
        if offloaded:
            copy_stream, host_grads = self._start_grad_copies(offloaded)
        for p, group in on_device:
            self._update(p, group, _grad(p))
        if copy_stream is not None:
            copy_stream.synchronize()  # the host must not read a gradient before its copy has landed
        for p, group in offloaded:
            self._update(p, group, host_grads[p])
        return None

    def _update_streamed(self, offloaded: list) -> None:
        items, settings = [], []
        for p, group in offloaded:
            state = self.state[p]
            self._count_on_device(p)
            local = _local(p)
            items.append((local, _local(_grad(p)), state))
            settings.append(dict(step=int(state["step"]), lr=group["lr"], beta1=group["betas"][0],
                                 beta2=group["betas"][1], eps=group["eps"],
                                 weight_decay=group["weight_decay"] if local.dim() >= 2 else 0.0))

        def update(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], index: int) -> None:
            # an offloaded fp32 parameter carries a master copy for the host update; here it is its own master,
            # and its host copy is kept equal to it
            fp32_param = param.dtype == torch.float32
            fused_cuda.fused_adam_update(param, grad, state["exp_avg"], state["exp_avg_sq"],
                                         master=None if fp32_param else state.get("master"),
                                         remainder=state.get("remainder"), grad_scale=self._scale_on(param.device),
                                         skip=self._skip, **settings[index])
            if fp32_param and "master" in state:
                state["master"].copy_(param)

        self._streamed.run(items, update)

    def _start_grad_copies(self, offloaded):
        host_grads = {}
        stream = None
        if self.config.overlap and torch.cuda.is_available() and _local(offloaded[0][0]).is_cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for p, _ in offloaded:
                grad = _local(_grad(p))
                host_grads[p] = grad.to("cpu", non_blocking=stream is not None)
        return stream, host_grads

    def _count_on_device(self, p: torch.nn.Parameter) -> None:
        self.state[p]["step"] += 1
        if self._skip is not None:
            self._counted_on_device.append(p)

    def forget_skipped_step(self) -> None:
        """Uncount the last step's GPU updates: called when its ``skip`` turned out true (they changed nothing)."""
        for p in self._counted_on_device:
            self.state[p]["step"] -= 1
        self._counted_on_device = []

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        """The step's gradient scale as an fp32 scalar on ``device``, made once per step."""
        scale = self._device_scales.get(device)
        if scale is None:
            given = self._grad_scale
            scale = given.to(device, torch.float32) if torch.is_tensor(given) else \
                torch.full((), given, dtype=torch.float32, device=device)
            self._device_scales[device] = scale
        return scale

    def _read_on_host(self) -> tuple[float, bool]:
        """(gradient scale, skip) for the host updates, read back once per step (the one wait for the device)."""
        if self._host_reads is None:
            self._host_reads = (float(self._grad_scale), self._skip is not None and bool(self._skip))
        return self._host_reads

    def _update(self, p: torch.nn.Parameter, group: dict, grad: torch.Tensor) -> None:
        state = self.state[p]
        local = _local(p)
        state_device = state["exp_avg"].device
        beta1, beta2 = group["betas"]
        weight_decay = group["weight_decay"] if local.dim() >= 2 else 0.0
        grad = _local(grad)
        if fused_cuda.available(local) and state_device == local.device:
            self._count_on_device(p)
            fused_cuda.fused_adam_update(
                local, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], master=state.get("master"),
                remainder=state.get("remainder"), step=int(state["step"]), lr=group["lr"], beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=weight_decay, grad_scale=self._scale_on(local.device),
                skip=self._skip)
            return
        if self._read_on_host()[1]:
            return
        state["step"] += 1
        # the state's device does the math; a parameter living elsewhere (offloaded state) is brought over once
        param = local if local.device == state_device and local.is_contiguous() else \
            local.to(state_device).contiguous()
        grad = grad.to(state_device).contiguous()
        # on the CPU, slices that stay in cache: a whole-tensor op per step of the update is memory-bound
        chunk = _CPU_CHUNK if state_device.type == "cpu" else max(1, param.numel())
        views = {k: state[k].view(-1) for k in ("exp_avg", "exp_avg_sq", "master", "remainder") if k in state}
        flat_param, flat_grad = param.view(-1), grad.view(-1)
        for start in range(0, flat_param.numel(), chunk):
            part = slice(start, start + chunk)
            self._update_slice(flat_param[part], flat_grad[part], {k: v[part] for k, v in views.items()},
                               step=int(state["step"]), lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                               weight_decay=weight_decay)
        if param is not local:
            local.copy_(param, non_blocking=self.config.overlap)

    def _update_slice(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], **math) -> None:
        grad32 = grad.float()
        scale = self._read_on_host()[0]
        if scale != 1.0:
            grad32 = grad32 * scale
        if "master" in state:
            master = state["master"]
        elif "remainder" in state:
            master = join_master(param, state["remainder"])
        else:
            master = param  # an fp32 parameter is its own master
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        adam_math(master, grad32, exp_avg, exp_avg_sq, **math)
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        if "remainder" in state:
            new_param, remainder = split_master(master)
            state["remainder"].copy_(remainder)
            param.copy_(new_param)
        elif master is not param:
            param.copy_(master)

    def state_dict(self) -> dict:
        """As torch's, with the state of sharded (DTensor) parameters wrapped as DTensors of the same layout, so
        torch.distributed.checkpoint can save and reshard it."""
        self.wait_for_host_state()
        saved = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in saved["state"].items():
            param = params[index]
            if not is_sharded(param):
                continue
            saved["state"][index] = {key: shard_like(param, value) if torch.is_tensor(value) and value.dim() > 0
                                     else value for key, value in values.items()}
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy saved values into the existing state tensors. torch's default would cast fp32 masters and moments to
        the bf16 parameter dtype and move offloaded state to the parameter's device."""
        self.wait_for_host_state()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(saved_groups)} parameter groups, expected {len(self.param_groups)}")
        index_to_param = {}
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("optimizer state does not match the parameters (different parameter count)")
            index_to_param.update(zip(saved["params"], group["params"]))
            group.update({k: v for k, v in saved.items() if k != "params"})
        for index, values in state_dict["state"].items():
            state = self.state[index_to_param[index]]
            for key, value in values.items():
                if key not in state:
                    raise ValueError(f"optimizer state key {key!r} does not exist in this optimizer's configuration")
                target = state[key]
                source = _local(value) if torch.is_tensor(value) else value
                target.copy_(source.reshape(target.shape) if torch.is_tensor(source) else torch.as_tensor(source))

    def master_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """The fp32 master of every parameter (rebuilt from remainders where they are used)."""
        self.wait_for_host_state()
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "master" in state:
                    out[p] = state["master"].clone()
                elif "remainder" in state:
                    out[p] = join_master(_local(p).to(state["remainder"].device), state["remainder"])
                else:
                    out[p] = _local(p).detach().clone()
        return out

    def wait_for_host_state(self) -> None:
        """Block until offloaded state streamed through the GPU is back in host memory (before reading it there)."""
        self._streamed.wait()

    def offloaded_fraction(self) -> float:
        total = sum(_local(p).numel() for g in self.param_groups for p in g["params"])
        return sum(_local(p).numel() for p in self._offloaded) / max(1, total)


def _choose_offloaded(params: list[torch.nn.Parameter], fraction: float) -> set:
    """Whole parameters, in order, until they hold at least ``fraction`` of all elements."""
    if fraction <= 0:
        return set()
    total = sum(_local(p).numel() for p in params)
    chosen, held = set(), 0
    for p in params:
        if held >= fraction * total:
            break
        chosen.add(p)
        held += _local(p).numel()
    return chosen


def _grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    main_grad = getattr(p, "main_grad", None)
    return main_grad if main_grad is not None else p.grad


def _empty_like(t: torch.Tensor, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    return pinned_zeros(t.shape, dtype) if pin else torch.empty(t.shape, dtype=dtype, device=device)


def _zeros(t: torch.Tensor, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    return pinned_zeros(t.shape, dtype) if pin else torch.zeros(t.shape, dtype=dtype, device=device)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

