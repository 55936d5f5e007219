"""``long_context_worker`` for LoRA runs that also records, on every rank, what the model it trains holds: the dtypes
of the frozen base (fp32-pinned modules aside) and of the adapters, and the bytes of each this rank keeps (its shards
and experts). Writes RUN_DIR/params-rank{R}.json before the run's first step."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.distributed import long_context_worker


def _record(model: torch.nn.Module, run_dir: Path) -> None:
    from openrecipes.models.common.precision import fp32_parameter_names

    pinned = set(fp32_parameter_names(model))
    parts: dict[str, dict] = {"base": {"dtypes": set(), "bytes": 0}, "adapters": {"dtypes": set(), "bytes": 0}}
    for name, param in model.named_parameters():
        if name in pinned:
            continue
        part = parts["adapters" if param.requires_grad else "base"]
        local = param.to_local() if isinstance(param, DTensor) else param
        part["dtypes"].add(str(local.dtype).removeprefix("torch."))
        part["bytes"] += local.numel() * local.element_size()
    rank = dist.get_rank() if dist.is_initialized() else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"params-rank{rank}.json").write_text(json.dumps(
        {key: {"dtypes": sorted(value["dtypes"]), "bytes": value["bytes"]} for key, value in parts.items()}))


def main(spec: Path) -> None:
    from openrecipes.train import engine

    build_model = engine.build_model

    def recording(recipe, device, parallel=None):
        model, grads = build_model(recipe, device, parallel)
        _record(model, Path(recipe.run_dir))
        return model, grads

    engine.build_model = recording
    long_context_worker.main(spec)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
