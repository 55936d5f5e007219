"""Training checkpoints with torch.distributed.checkpoint, written so a crash never replaces the last good one.

RUN_DIR/checkpoints/step-000012/   one DCP directory per save (model, optimizer, trainer state)
RUN_DIR/checkpoints/latest         the name of the newest complete save, replaced atomically after it is written

A save goes to a hidden staging directory first and is renamed into place once every rank has finished writing.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from openrecipes.checkpoint.checksums import write_checksums
from openrecipes.checkpoint.safe_load import load_dcp
from openrecipes.utils import atomic_write_text

LATEST = "latest"


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    options = StateDictOptions(strict=True)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        "trainer": {"step": torch.tensor(step, dtype=torch.int64)},
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard on this rank


def first_nonfinite(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """The name of this rank's first parameter (or optimizer state of one) holding inf or nan, or None."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(_local(param.detach())).all()):
            return name
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(_local(value)).all()):
                return f"{name} (optimizer state {key!r})"
    return None


def check_finite(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Refuse to save a poisoned state: a checkpoint holding inf/nan would be resumed from as the last good one.

    Every rank takes part (the decision must be the same everywhere, or the others would wait at the save)."""
    bad = first_nonfinite(model, optimizer)
    if dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([0.0 if bad else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0.0 and bad is None:
            bad = "a parameter held by another rank"
    if bad:
        raise ValueError(f"step {step}: {bad} holds non-finite values; checkpoint step-{step:06d} was not written "
                         "(the last good checkpoint is kept)")


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, *,
                    keep: int) -> Path:
    check_finite(model, optimizer, step)
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    staging = root / f".step-{step:06d}.partial"
    if _is_main():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(_state(model, optimizer, step), checkpoint_id=str(staging))
    write_checksums(staging)  # last file of the save, before the rename makes it complete
    _barrier()
    if _is_main():
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        atomic_write_text(root / LATEST, final.name + "\n")
        complete = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / ".metadata").is_file():
        raise ValueError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a save into ``model`` and ``optimizer`` (resharding to the current layout); returns its step."""
    state = _state(model, optimizer, 0)
    load_dcp(state, path)  # restricted: a checkpoint's pickles cannot run code
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return int(state["trainer"]["step"])
