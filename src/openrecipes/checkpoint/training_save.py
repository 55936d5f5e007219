"""The training checkpoint format: what train saves and resumes from and what ``convert export`` reads
(checkpoint/training_export.py), torch.distributed.checkpoint directories written so a crash never replaces the last
good one.

RUN_DIR/checkpoints/step-000012/   one DCP directory per save: ``model``, ``optimizer`` and ``trainer`` state
RUN_DIR/checkpoints/latest         the name of the newest complete save, replaced atomically after it is written
RUN_DIR/checkpoints/history        the names of the saves in the order they were made (one per line, appended)

A save goes to a hidden staging directory (.step-000012.partial) first and is renamed into place once every rank has
finished writing. Its name is appended to ``history`` just before the rename, so the save order is known even when a
run is killed between the rename and ``latest``; pruning keeps the newest saves in that order (never by name: a
leftover higher-numbered directory from an earlier attempt is not newer), and a resume uses the newest complete save.
"""

from __future__ import annotations

import os
import re
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
from openrecipes.checkpoint.safe_load import METADATA_FILE, load_dcp, read_dcp_metadata
from openrecipes.config.rundir import CHECKPOINTS_DIR, RECIPE_FILE, STEP_DIR, checkpoint_name
from openrecipes.utils import atomic_write_text

LATEST = "latest"
HISTORY = "history"
_STAGING_DIR = re.compile(rf"\.{STEP_DIR.pattern}\.partial")  # a save's staging directory
MODEL_KEY, OPTIMIZER_KEY, TRAINER_KEY = "model", "optimizer", "trainer"  # the parts of a save
MODEL_PREFIX = MODEL_KEY + "."  # the model's tensors in a save's metadata


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    options = StateDictOptions(strict=True)
    return {
        MODEL_KEY: get_model_state_dict(model, options=options),
        OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer, options=options),
        TRAINER_KEY: {"step": torch.tensor(step, dtype=torch.int64)},
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard on this rank


def first_nonfinite(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """The name of this rank's first parameter (or optimizer state of one) holding inf or nan, or None."""
    wait = getattr(optimizer, "wait_for_host_state", None)  # offloaded state still being copied back
    if wait is not None:
        wait()
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
        raise ValueError(f"step {step}: {bad} holds non-finite values; checkpoint {checkpoint_name(step)} was not "
                         "written (the last good checkpoint is kept)")


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, *,
                    keep: int) -> Path:
    check_finite(model, optimizer, step)
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / checkpoint_name(step)
    staging = root / f".{final.name}.partial"
    if _is_main():
        remove_stale_staging(run_dir)
        staging.mkdir(parents=True)
    _barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(_state(model, optimizer, step), checkpoint_id=str(staging))
    write_checksums(staging)  # last file of the save, before the rename makes it complete
    _barrier()
    if _is_main():
        _append_history(root, final.name)
        shutil.rmtree(final, ignore_errors=True)  # a save of this step from an earlier attempt
        staging.rename(final)
        atomic_write_text(root / LATEST, final.name + "\n")
        _prune(root, keep)
    _barrier()
    return final


def remove_stale_staging(run_dir: Path) -> None:
    """Staging directories of saves that never finished (a killed run); only names this module writes."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if root.is_dir():
        for path in root.iterdir():
            if _STAGING_DIR.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)


def _append_history(root: Path, name: str) -> None:
    with open(root / HISTORY, "a") as handle:
        handle.write(name + "\n")
        handle.flush()
        os.fsync(handle.fileno())  # on disk before the rename it describes


def _save_order(root: Path) -> dict[str, int]:
    """Position of each save in ``history`` (the last time a name was saved counts)."""
    if not (root / HISTORY).is_file():
        return {}
    lines = (root / HISTORY).read_text(errors="replace").splitlines()
    return {line.strip(): position for position, line in enumerate(lines)}


def _complete_saves(root: Path, order: dict[str, int]) -> list[Path]:
    """Complete save directories, oldest first in save order; ones ``history`` does not list (written before it
    existed) count as older than every listed one, in step order among themselves."""
    saves = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
             and (p / METADATA_FILE).is_file()] if root.is_dir() else []
    return sorted(saves, key=lambda p: (order.get(p.name, -1), p.name))


def _prune(root: Path, keep: int) -> None:
    saves = _complete_saves(root, _save_order(root))
    for old in saves[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    kept = {p.name for p in saves[-keep:]}
    # the history keeps only what exists, so it stays a few lines long
    lines = [n.strip() for n in (root / HISTORY).read_text(errors="replace").splitlines() if n.strip() in kept]
    atomic_write_text(root / HISTORY, "".join(line + "\n" for line in lines))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete save: what ``latest`` names, or a save made after it (the run was killed between
    the rename and writing ``latest``); None when there is none. ``latest`` naming anything but a save directory
    of this run (another path, ``..``) is refused."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    pointer = root / LATEST
    named: Path | None = None
    if pointer.is_file():
        name = pointer.read_text(errors="replace").strip()
        if not STEP_DIR.fullmatch(name):
            raise ValueError(f"{pointer} names {name!r}, which is not a checkpoint directory of this run "
                             "(expected step-NNNNNN inside checkpoints/)")
        named = root / name
        if named.is_symlink() or not (named / METADATA_FILE).is_file():
            raise ValueError(f"{pointer} names {name}, which is not a complete checkpoint")
    order = _save_order(root)
    saves = _complete_saves(root, order)
    if not saves:
        return named
    newest = saves[-1]
    if named is None or (newest != named and newest.name in order):
        return newest  # saved after what `latest` names: the run stopped before it could update `latest`
    return named


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a save into ``model`` and ``optimizer`` (resharding to the current layout); returns its step.

    The fp32 master of a bf16 recipe's weight lives in one of two places (``train/engine.py`` ``parameter_dtype``):
    the parameter itself where FSDP2 shards it (dp > 1), else the optimizer's ``master`` beside a bf16 parameter.
    A save of one kind resumes under a layout of the other: each master is read from where the save keeps it."""
    state = _state(model, optimizer, 0)
    saved = read_dcp_metadata(Path(path) / METADATA_FILE).state_dict_metadata
    masters = {MODEL_KEY: {}, OPTIMIZER_KEY: {"state": {}}}  # a second read: each master from the save's place for it
    for name, values in state[OPTIMIZER_KEY]["state"].items():
        in_save = f"{OPTIMIZER_KEY}.state.{name}.master" in saved
        if "master" in values and not in_save:  # the save's parameter is the master
            masters[MODEL_KEY][name] = values.pop("master")
        elif "master" not in values and in_save and state[MODEL_KEY][name].dtype == torch.float32:
            masters[OPTIMIZER_KEY]["state"][name] = {"master": state[MODEL_KEY][name]}  # this parameter is the master
    load_dcp(state, path)  # restricted: a checkpoint's pickles cannot run code
    if masters[MODEL_KEY] or masters[OPTIMIZER_KEY]["state"]:
        load_dcp(masters, path)
        for name, master in masters[MODEL_KEY].items():
            state[OPTIMIZER_KEY]["state"][name]["master"] = master
    set_model_state_dict(model, state[MODEL_KEY])
    set_optimizer_state_dict(model, optimizer, state[OPTIMIZER_KEY])
    return int(state[TRAINER_KEY]["step"])


def run_dir_of(ckpt_dir: str | Path) -> Path | None:
    """The run directory a training save sits in (``RUN_DIR/checkpoints/step-NNNNNN``), or None when ``ckpt_dir``
    is not one."""
    ckpt_dir = Path(ckpt_dir)
    run_dir = ckpt_dir.parent.parent
    if ckpt_dir.parent.name != CHECKPOINTS_DIR or not (ckpt_dir / METADATA_FILE).is_file():
        return None
    return run_dir if (run_dir / RECIPE_FILE).is_file() else None


def read_model_state(ckpt_dir: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model part of a save, read whole into CPU tensors in the dtypes the save records, whatever layout wrote
    it (DCP reshards); the save must hold exactly the parameters ``expected`` names, in their shapes (a meta
    model's ``named_parameters``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(ckpt_dir / METADATA_FILE).state_dict_metadata
    stored = {key.removeprefix(MODEL_PREFIX): item for key, item in metadata.items() if key.startswith(MODEL_PREFIX)}
    missing = [name for name in expected if name not in stored]
    unknown = [name for name in stored if name not in expected]
    if missing or unknown:
        raise ValueError(f"{ckpt_dir}: the save does not hold this model's parameters (missing: {missing[:3]}, "
                         f"unknown: {unknown[:3]}); was RUN_DIR/{RECIPE_FILE} edited after the run?")
    state = {}
    for name, param in expected.items():
        item = stored[name]
        if not isinstance(item, TensorStorageMetadata) or tuple(item.size) != tuple(param.shape):
            shape = tuple(item.size) if isinstance(item, TensorStorageMetadata) else type(item).__name__
            raise ValueError(f"{ckpt_dir}: {MODEL_PREFIX}{name} is stored as {shape}, the model has "
                             f"{tuple(param.shape)}")
        state[name] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    load_dcp({MODEL_KEY: state}, ckpt_dir, no_dist=True)  # checksums checked; its pickles cannot run code
    return state
