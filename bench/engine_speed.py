"""Training throughput of the engine on reduced-depth Qwen3-30B-A3B (real widths), one GPU.

Variants: the workloads of bench/workloads.yaml (each a run of `openrecipes train`'s loop, 20 steps and window steps
5-18 unless the entry says otherwise; entries with `profile: true` profile their last step). Run them beside their
peers, in rounds, with bench/run.py.
Recipe: bf16, full recompute (uniform, 1 layer) unless the variant says otherwise, precision-aware Adam (int16 remainders, bf16 moments; the
two-GPU runs keep fp32 masters and moments sharded by FSDP2), grad clip 1.0, no checkpoints. Results (tokens/s/GPU,
MFU with the run's N (766,246,912 for Qwen3 at 8 layers), step-time CV, peak memory) go to --out as JSON. Without a
GPU every variant trains its family's tiny registered config on 256-token rows (a plumbing check).

Usage: python bench/engine_speed.py --out results.json [--variants single_bal,...] [--layers 8] [--steps 20]
       [--memory-trace] [--timeline]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from openrecipes.measure import measure_run_dir  # noqa: E402
from openrecipes.models.resolve import resolve_model_config  # noqa: E402
from openrecipes.train.loop import train  # noqa: E402
from openrecipes.config.recipe import recipe_from_dict  # noqa: E402
from openrecipes.utils import sha256_file  # noqa: E402

from workloads import LORA, default_window, load_workloads  # noqa: E402  (bench/, beside this file)

# the workloads, declared in bench/workloads.yaml (one entry each, validated by bench/workloads.py)
VARIANTS = {name: workload.engine_spec() for name, workload in load_workloads().items()}
PROFILED = tuple(name for name, workload in load_workloads().items() if workload.profile)


def write_rows(out: Path, *, rows: int, row_tokens: int, vocab: int, packed: bool, seed: int = 0) -> Path:
    """Synthetic rows in the `openrecipes data build` format: random ids, every target supervised."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(rows, row_tokens), dtype=np.int32)
    mask = np.ones((rows, row_tokens), dtype=np.int8)
    doc_lens = []
    for _ in range(rows):
        if not packed:
            doc_lens.append([row_tokens])
            continue
        lens, left = [], row_tokens
        while left > 0:
            n = min(left, int(rng.integers(200, 1801)))
            lens.append(n)
            left -= n
        doc_lens.append(lens)
    out.mkdir(parents=True, exist_ok=True)
    table = pa.table({"input_ids": [list(r) for r in ids], "loss_mask": [list(m) for m in mask],
                      "doc_lens": doc_lens},
                     schema=pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                                       ("doc_lens", pa.list_(pa.int32()))]))
    pq.write_table(table, out / "rows.parquet")
    # train checks the parquet file against the manifest's hash before it reads a row
    manifest = {"rows": rows, "row_tokens": row_tokens, "synthetic": True,
                "parquet_sha256": sha256_file(out / "rows.parquet")}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def model_and_rows(spec: dict, *, layers: int, tiny: bool) -> tuple[str, dict, int]:
    """The registered model, its overrides and the row length a workload trains (CPU runs: its tiny model)."""
    model = spec.get("tiny_model", "qwen3-moe-tiny") if tiny else spec.get("model", "qwen3-30b-a3b")
    overrides = {} if tiny else spec.get("overrides", {"num_hidden_layers": spec.get("layers", layers)})
    return model, overrides, 256 if tiny else spec.get("row_tokens", 8192)


def recipe_tree(name: str, spec: dict, *, layers: int, steps: int, rows_dir: Path, workdir: Path, tiny: bool,
                memory_trace: bool = False, timeline: bool = False) -> dict:
    """The recipe (as a dict) the engine trains a workload with: its model, rows, layout, recompute, kernels,
    optimizer and debug switches."""
    model, overrides, row_tokens = model_and_rows(spec, layers=layers, tiny=tiny)
    nproc = spec.get("nproc", 1)
    return {
        "name": f"engine-speed-{name}",
        "model": model,
        "model_overrides": overrides,
        "data": {"rows": str(rows_dir)},
        "layout": {"max_tokens_per_gpu": row_tokens * spec.get("rows_per_microbatch", 1) // spec.get("cp", 1),
                   "rows_per_microbatch": spec.get("rows_per_microbatch", 1), "dp": spec.get("dp", nproc), "ep": spec.get("ep", 1),
                   "tp": spec.get("tp", 1), "cp": spec.get("cp", 1), "sequence_parallel": spec.get("tp", 1) > 1},
        "offload": {"fraction": spec.get("offload", 0.0), "update": spec.get("offload_update", "device")},
        "recompute": {"granularity": spec.get("recompute", "full"), "method": "uniform", "num_layers": 1},
        "kernels": {"compile": spec.get("compile", False), "attention": spec.get("attention", "auto"),
                    "loss_chunk_tokens": spec.get("loss_chunk", 0)},
        "optimizer": {"lr": 1e-5, "min_lr": 1e-6, "warmup_fraction": 0.1, "weight_decay": 0.1,
                      "betas": [0.9, 0.98], "grad_clip": 1.0, "precision_aware": spec.get("precision_aware", nproc == 1),
                      "moment_dtype": "bf16" if spec.get("precision_aware", nproc == 1) else "fp32"},
        "precision": "bf16", "steps": steps, "global_batch": spec["rows_per_step"], "seed": 0,
        "run_dir": str(workdir / f"run-{name}"), "checkpoint": {"at_end": False},
        "logging": {"progress": True},
        **({"lora": dict(LORA)} if spec.get("lora") else {}),
        **({"fp8": {"scaling": "rowwise", "targets": spec["fp8"]}} if spec.get("fp8") else {}),
        "debug": {"force_load_balance": spec["balanced"], "memory_trace": memory_trace,
                        "profile_step": steps - 1 if name in PROFILED else None, "profile_timeline": timeline},
    }


def run_variant(name: str, spec: dict, *, layers: int, steps: int, workdir: Path, device_type: str,
                memory_trace: bool = False, timeline: bool = False) -> dict:
    steps = spec.get("steps", steps)  # slow variants run fewer steps (window 5..steps-2)
    tiny = device_type == "cpu"
    model, overrides, row_tokens = model_and_rows(spec, layers=layers, tiny=tiny)
    vocab = resolve_model_config(model, overrides=overrides).vocab_size  # the ids the model embeds
    rows_dir = write_rows(workdir / f"rows-{name}", rows=steps * spec["rows_per_step"], row_tokens=row_tokens,
                          vocab=vocab, packed=spec["packed"])
    nproc = spec.get("nproc", 1)
    tree = recipe_tree(name, spec, layers=layers, steps=steps, rows_dir=rows_dir, workdir=workdir, tiny=tiny,
                       memory_trace=memory_trace, timeline=timeline)
    run_dir = Path(tree["run_dir"])
    started = time.perf_counter()
    if nproc > 1:
        import subprocess

        import yaml

        recipe_path = workdir / f"recipe-{name}.yaml"
        recipe_path.write_text(yaml.safe_dump(tree))
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([sys.executable, "-m", "openrecipes", "train", str(recipe_path), "--nproc", str(nproc)],
                       check=True, env=env)
    else:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        train(recipe_from_dict(tree), command=f"bench/engine_speed.py {name}")
    wall = time.perf_counter() - started
    window = tuple(spec["window"]) if "window" in spec else default_window(steps)
    measured = measure_run_dir(run_dir, window=window,
                               gpu_type="H200" if device_type == "cuda" else None).to_dict()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = {"variant": name, **spec, "trained_model": model, "row_tokens": row_tokens, "wall_s": wall,
              "measure": measured, "step_times_s": [r["step_time_s"] for r in records], "losses": [r["loss"] for r in records]}
    if any("memory_phases_gib" in r for r in records):  # --memory-trace: rank 0's memory per phase
        result["memory_phases_gib"] = [r.get("memory_phases_gib") for r in records]
    profile = run_dir / "profile.txt"
    if profile.is_file():
        result["profile"] = profile.read_text()
    if (run_dir / "profile_trace.json").is_file():  # --timeline: where the GPU waited in the profiled step
        from step_gaps import summarize

        result["gaps"] = summarize(run_dir / "profile_trace.json", top=15, min_gap_us=50.0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default="single_bal,single_nat,packed_bal,accum8_bal")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--memory-trace", action="store_true", help="record rank 0's memory per step phase")
    parser.add_argument("--timeline", action="store_true",
                        help="profiled variants also keep the step's timeline and report where the GPU waited")
    args = parser.parse_args()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    report = {"benchmark": "engine_speed", "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name() if device_type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "layers": args.layers, "steps": args.steps,
              "results": results}
    with tempfile.TemporaryDirectory() as tmp:
        names = args.variants.split(",")
        for name in names:
            # the profiled step is the last one, outside the timing window (profiling slows the steps around it)
            try:
                if device_type == "cuda" and len(names) > 1:
                    # each variant in its own process: compiled code and the caching allocator keep an earlier
                    # variant's memory, which a later variant's peak (or out-of-memory) would include
                    part = Path(tmp) / f"{name}.json"
                    import subprocess

                    subprocess.run([sys.executable, __file__, "--out", str(part), "--variants", name,
                                    "--layers", str(args.layers), "--steps", str(args.steps)]
                                   + (["--memory-trace"] if args.memory_trace else [])
                                   + (["--timeline"] if args.timeline else []), check=False)
                    results.append(json.loads(part.read_text())["results"][0] if part.is_file()
                                   else {"variant": name, "error": "the variant's process wrote no result"})
                else:
                    results.append(run_variant(name, VARIANTS[name], layers=args.layers, steps=args.steps,
                                               workdir=Path(tmp), device_type=device_type,
                                               memory_trace=args.memory_trace, timeline=args.timeline))
                if "error" in results[-1]:
                    raise RuntimeError(results[-1]["error"])
            except Exception as error:  # keep what the other variants measured
                if not results or results[-1].get("variant") != name:
                    results.append({"variant": name, "error": repr(error)})
                print(f"RESULT {name}: failed: {error!r}", flush=True)
                continue
            finally:
                # written after every variant, so a later failure loses nothing already measured
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
            m = results[-1]["measure"]
            print(f"RESULT {name}: {m.get('tokens_per_s_per_gpu')} tok/s/GPU, MFU {m.get('mfu')}, "
                  f"CV {m.get('step_time_cv')}, peak {m.get('peak_memory_gib')} GiB", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
