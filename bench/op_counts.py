"""Host work per decoder layer under a parallel layout, counted on CPU (gloo): aten ops, collectives, DTensor
dispatches and host syncs of one training step (forward, recompute, backward, gradient sync, optimizer).

Per-layer numbers are the difference between a 4-layer and a 2-layer model, halved, so the embedding, LM head,
loss and optimizer drop out. The tiny Qwen3-MoE (hidden 64) in bf16, full recompute, balanced routing, one packed
256-token row per step shared by the ranks of the layout. Counts, not times: the 2-core CPU machine is shared.

Usage: python bench/op_counts.py --out counts.json [--layouts tp2,cp2,dp2]
       (each layout runs under torchrun as `python bench/op_counts.py --worker LAYOUT LAYERS OUT`)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"tp2": dict(tp=2, sequence_parallel=True), "cp2": dict(cp=2), "dp2": dict(dp=2)}
PROFILE_STEP = 2  # steps 0 and 1 warm up (caches of sharding propagation, allocator)


def _is_collective(name: str) -> bool:
    # the c10d op, not the backend's own record of it (gloo:all_reduce), nor waits
    return name.startswith(("c10d::", "_c10d_functional::")) and "wait" not in name and "wrap" not in name


EXCLUDED = "excluded-phase"
# ops that read a value back to the host on CUDA (bincount: its largest input, to size the output; nonzero: the count),
# though their CPU versions do not show it as a separate read
SYNCING_ON_CUDA = ("aten::_local_scalar_dense", "aten::bincount", "aten::nonzero", "aten::masked_select",
                   "aten::_unique2")


_inside_excluded = [0]


def _marked(fn):
    from torch.profiler import record_function

    def call(*args, **kwargs):
        _inside_excluded[0] += 1
        try:
            with record_function(EXCLUDED):
                return fn(*args, **kwargs)
        finally:
            _inside_excluded[0] -= 1
    return call


def _under_excluded_phase(event) -> bool:
    while event is not None:
        if event.name == EXCLUDED:
            return True
        event = event.cpu_parent
    return False


def _grouped_linear_without_sync(x_RI, weight_EOI, counts_E, offsets_E=None, backend=None):
    """Stands in for ``torch._grouped_mm`` (whose CPU version has no backward for these shapes): every row through
    every expert, then each row's own; a fixed handful of ops and no host sync, like the GPU path, where the
    per-expert CPU loop would issue ops per expert and read the counts back."""
    import torch

    expert_R = torch.repeat_interleave(torch.arange(len(counts_E)), counts_E, output_size=x_RI.shape[0])
    every_REO = torch.einsum("ri,eoi->reo", x_RI, weight_EOI)
    return every_REO[torch.arange(x_RI.shape[0]), expert_R]


def worker(layout: str, layers: int, out: str) -> None:
    import torch
    import torch.distributed.tensor as dtensor
    import torch.utils._pytree as pytree
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(ROOT / "src"))
    from openrecipes.config.recipe import recipe_from_dict
    from openrecipes.models.common import moe
    from openrecipes.optim.adam import MixedPrecisionAdam
    from openrecipes.train import loop

    spec = LAYOUTS[layout]
    dp = spec.get("dp", 1)
    workdir = Path(tempfile.mkdtemp())
    sys.path.insert(0, str(ROOT / "bench"))
    from engine_speed import write_rows

    rows = write_rows(workdir / "rows", rows=4 * dp, row_tokens=256, vocab=1024, packed=True)
    tree = {
        "name": f"op-counts-{layout}", "model": "qwen3-moe-tiny", "model_overrides": {"num_hidden_layers": layers},
        "data": {"rows": str(rows)},
        "layout": {"max_tokens_per_gpu": 256 // spec.get("cp", 1), "dp": dp, "tp": spec.get("tp", 1),
                   "cp": spec.get("cp", 1), "sequence_parallel": spec.get("sequence_parallel", False)},
        "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1},
        "optimizer": {"lr": 1e-4, "precision_aware": True, "moment_dtype": "bf16"},
        "precision": "bf16", "steps": PROFILE_STEP + 1, "global_batch": dp, "seed": 0,
        "run_dir": str(workdir / "run"), "checkpoint": {"at_end": False}, "logging": {"progress": False},
        "debug": {"force_load_balance": True, "profile_step": PROFILE_STEP},
    }
    counts: dict[str, int] = {}
    dispatches = collections.Counter()

    class CountDTensorOps(TorchDispatchMode):
        """Ops with a DTensor argument: each goes through DTensor's sharding propagation on the host."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not _inside_excluded[0] and any(isinstance(a, dtensor.DTensor) for a in pytree.tree_leaves((args, kwargs or {}))):
                dispatches["dtensor_ops"] += 1
            return func(*args, **(kwargs or {}))

    def profiled(run_dir, sort, fn):  # as train/loop.py's _profiled, counting instead of writing a table
        syncs = collections.Counter()
        originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist")}

        def counting(name):
            def call(self, *a, **k):
                syncs[f"tensor.{name}"] += 0 if _inside_excluded[0] else 1
                return originals[name](self, *a, **k)
            return call

        for name in originals:
            setattr(torch.Tensor, name, counting(name))
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                record = fn()
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
        # the optimizer (a per-tensor CPU fallback here, one fused Triton kernel on the GPU) and the gradient norm are
        # left out: the counts are of the forward, backward and gradient synchronisation
        events = [e for e in prof.events() if not _under_excluded_phase(e)]
        # a collective op may record itself twice (the c10d op inside its Python-side record): count the outer one
        collectives = collections.Counter(e.name for e in events if _is_collective(e.name) and not (
            e.cpu_parent is not None and _is_collective(e.cpu_parent.name)))
        counts.update({
            "aten_ops": sum(1 for e in events if e.name.startswith("aten::")),
            "aten_ops_top_level": sum(1 for e in events if e.name.startswith("aten::") and (
                e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))),
            # a tensor's value read on the host (.item(), .tolist(), and C++ reads like bincount's output size): on
            # a GPU each one waits for the device, so the host cannot run ahead of it
            "host_reads": sum(1 for e in events if e.name in SYNCING_ON_CUDA),
            "collectives": sum(collectives.values()),
            **{f"collective {name}": n for name, n in collectives.items()},
            **dispatches, **syncs,
            **{f"op {name}": n for name, n in collections.Counter(
                e.name for e in events if e.name.startswith("aten::")).items()},
        })
        return record

    loop._profiled = profiled
    original_step = loop.train_step

    def train_step(*args, **kwargs):
        # DTensor ops are counted in the step before the profiled one: under a dispatch mode the profiler would
        # record every op twice
        if args[4] == PROFILE_STEP - 1:
            with CountDTensorOps():
                return original_step(*args, **kwargs)
        return original_step(*args, **kwargs)

    loop.train_step = train_step
    MixedPrecisionAdam.step = _marked(MixedPrecisionAdam.step)
    loop.grad_norm_and_clip_scale = _marked(loop.grad_norm_and_clip_scale)
    moe.grouped_linear = _grouped_linear_without_sync
    loop.train(recipe_from_dict(tree), command="bench/op_counts.py")
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(counts, indent=2, sort_keys=True))


def run_layout(layout: str, layers: int, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    __file__, "--worker", layout, str(layers), str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--layouts", default="tp2,cp2,dp2")
    parser.add_argument("--worker", nargs=3, metavar=("LAYOUT", "LAYERS", "OUT"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2])
        return
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            two, four = (run_layout(layout, n, Path(tmp) / f"{layout}-{n}.json") for n in (2, 4))
            per_layer = {k: (four.get(k, 0) - two.get(k, 0)) / 2 for k in sorted(set(two) | set(four))}
            report[layout] = {"per_layer": per_layer, "step_4_layers": four}
            print(layout, json.dumps(per_layer), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
