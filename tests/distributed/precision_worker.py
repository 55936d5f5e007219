"""``long_context_worker`` that also records, on every rank, what the model it trains holds: the dtypes and bytes of
its frozen parameters (a LoRA run's base) and its trained ones (fp32-pinned modules aside; this rank's shards and
experts), the bytes of the optimizer state built for them, those of the gradients the first step reduces, and a digest
of this rank's expert gradients as that step's optimizer reads them (ranks holding the same experts must agree).
Writes RUN_DIR/params-rank{R}.json as each is known."""

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.distributed import long_context_worker


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


class _Record:
    def __init__(self, run_dir: Path) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path, self.held = run_dir / f"params-rank{rank}.json", {}

    def add(self, **parts) -> None:
        self.held.update(parts)
        self.path.write_text(json.dumps(self.held))


def _parameters(model: torch.nn.Module) -> dict:
    from openrecipes.models.common.precision import fp32_parameter_names

    pinned = set(fp32_parameter_names(model))
    parts: dict[str, dict] = {"frozen": {"dtypes": set(), "bytes": 0}, "trained": {"dtypes": set(), "bytes": 0}}
    for name, param in model.named_parameters():
        if name in pinned:
            continue
        part = parts["trained" if param.requires_grad else "frozen"]
        part["dtypes"].add(str(_local(param).dtype).removeprefix("torch."))
        part["bytes"] += _bytes([param])
    return {key: {"dtypes": sorted(value["dtypes"]), "bytes": value["bytes"]} for key, value in parts.items()}


def _expert_grads_digest(model: torch.nn.Module) -> str:
    """sha256 of this rank's expert gradients in module order: the fp32 accumulator where one is kept, else .grad."""
    from openrecipes.parallel.expert import expert_parameters

    digest = hashlib.sha256()
    for param in expert_parameters(model):
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:
            digest.update(_local(grad).detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(spec: Path) -> None:
    from openrecipes.train import engine, loop

    build_model, optimizer_class = engine.build_model, loop.MixedPrecisionAdam
    current: list[_Record] = []

    def recording_model(recipe, config, parallel):
        model, grads = build_model(recipe, config, parallel)
        record = _Record(Path(recipe.run_dir))
        current[:] = [record]
        record.add(**_parameters(model))
        synchronize = grads.synchronize

        def recording_synchronize():  # the first step's gradients, as the optimizer will read them
            synchronize()
            if "grads_bytes" not in record.held:
                record.add(grads_bytes=_bytes(grads.gradients()), expert_grads=_expert_grads_digest(model))
        grads.synchronize = recording_synchronize
        return model, grads

    class RecordingOptimizer(optimizer_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            state = [t for s in self.state.values() for k, t in s.items() if k != "step"]
            current[0].add(optimizer_bytes=_bytes(state))

    engine.build_model, loop.MixedPrecisionAdam = recording_model, RecordingOptimizer
    long_context_worker.main(spec)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
