"""The host cost of the TP and CP code paths, measured on one GPU: the engine's tensor- (or context-) parallel
machinery over a group of one rank, beside the plain one-GPU run, on the same row.

A TP (CP) group of one rank runs everything TP2 (CP2) runs on the host (DTensor weights, the sequence gathers and
reduce-scatters, the replicated-gradient sums, CP's key/value gather and attention path), but each collective moves
only its own rank's data and the rank computes the whole row, not half. So the step time over the plain run's is the
machinery's own cost (host work the GPU waits on, extra kernels, the CP attention kernel), not a TP2 or CP2 throughput.
For when no machine of two GPUs is lent.

Variants (8 layers of Qwen3-30B-A3B widths, one packed 8,192-token row per step, balanced routing, bf16,
precision-aware Adam, full recompute; the engine_speed.py settings): plain, tp_machinery, cp_machinery; a suffix
_4096 (say) gives rows of that many tokens.
Usage: python bench/tp_cp_machinery_1gpu.py --out results.json [--variants plain,tp_machinery,cp_machinery]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_speed  # noqa: E402  (puts this tree's src first on sys.path)

SPEC = dict(packed=True, rows_per_step=1, balanced=True, precision_aware=True)


def one_rank_state(kind: str):
    """build_parallel_state's stand-in: a group of one rank in the role of TP (or CP); ``world_size`` 2 only turns
    on the engine's distributed paths."""
    from torch.distributed.device_mesh import init_device_mesh

    from openrecipes.parallel.mesh import ParallelState

    def build(layout, device):
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=(kind,))
        return ParallelState(rank=0, world_size=2, device=device, dp_rank=0, dp_size=1, ep_size=1, dense_mesh=None,
                             expert_mesh=None, tp_size=2 if kind == "tp" else 1, tp_mesh=mesh if kind == "tp" else None,
                             cp_size=2 if kind == "cp" else 1, cp_mesh=mesh if kind == "cp" else None)
    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default="plain,tp_machinery,cp_machinery")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cuda = torch.cuda.is_available()  # on CPU (gloo, the tiny model): a smoke test of the script
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", 0) if cuda else None)
    import openrecipes.parallel.mesh as mesh

    original = mesh.build_parallel_state
    results = []
    report = {"benchmark": "tp_cp_machinery_1gpu", "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "src": engine_speed.__file__,
              "layers": 8, "steps": args.steps, "results": results}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            # "tp_machinery_4096": the TP machinery on rows of 4,096 tokens (about a TP2 rank's work on 8,192)
            kind, *rest = name.split("_")
            spec = dict(SPEC, **({"row_tokens": int(rest[-1])} if rest and rest[-1].isdigit() else {}))
            mesh.build_parallel_state = original if kind == "plain" else one_rank_state(kind)
            try:
                results.append(engine_speed.run_variant(name, spec, layers=8, steps=args.steps, workdir=Path(tmp),
                                                        device_type="cuda" if cuda else "cpu"))
            except Exception as error:  # keep what the other variants measured
                results.append({"variant": name, "error": repr(error)})
                print(f"RESULT {name}: failed: {error!r}", flush=True)
                continue
            finally:
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
            m = results[-1]["measure"]
            profile = results[-1].get("profile", "")
            totals = [line for line in profile.splitlines() if "time total" in line]
            print(f"RESULT {name}: {m.get('tokens_per_s_per_gpu')} tok/s, mean step {m.get('step_time_mean_s')}, "
                  f"CV {m.get('step_time_cv')}; {' '.join(totals)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
