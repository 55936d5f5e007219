"""Training throughput of the engine on reduced-depth Qwen3-30B-A3B (real widths), one GPU.

Variants (each a 20-step run of `openrecipes train`'s loop; window steps 5-18; profiled variants profile step 19):
  single_bal   one 8,192-token document per row, 1 row per step, balanced routing  (the peers' workload)
  single_nat   same, natural routing from random init
  packed_bal   packed rows of many short documents (200-1,800 tokens), 1 row per step, balanced
  accum8_bal   8 single-document rows per step (8 microbatches of 1 row, gradient accumulation), balanced
  dp2_bal      two GPUs, FSDP2 data parallel, one packed row per GPU per step (fp32 masters sharded)
  dp2ep2_bal   two GPUs, expert parallel 2 inside DP2 (all-to-all dispatch)
  *_lora       rank-16 LoRA on q/k/v/o and every routed expert, frozen bf16 base; lora48: all 48 layers
  *_pa_*       the precision-aware optimizer sharded by FSDP2 (bf16 params + int16 remainders, bf16 moments);
               _off: half of the optimizer on the CPU; tp2 / cp2: two GPUs share each row; dp4*, tp2dp2ep4: 4 GPUs
  dsv3_bal*    DeepSeek-V3 at real widths, 4 layers, 24 experts, one 4,096-token row, 25 steps, window 5-19
               (bench/deepseek_v3_workload.py; transformers at the same workload: bench/hf_deepseek_v3.py)
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

import deepseek_v3_workload as dsv3  # noqa: E402  (bench/, beside this file)

MUSE_4L16E = {"num_hidden_layers": 4, "num_experts": 16,
              "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]}
# the workload bench/hf_deepseek_v3.py runs transformers at: one definition for both
DSV3 = dict(packed=False, rows_per_step=1, balanced=True, model=dsv3.MODEL, overrides=dict(dsv3.OVERRIDES),
            tiny_model=dsv3.TINY_MODEL, row_tokens=dsv3.ROW_TOKENS, steps=dsv3.STEPS, window=list(dsv3.WINDOW))

VARIANTS = {
    "single_bal": dict(packed=False, rows_per_step=1, balanced=True),
    "single_nat": dict(packed=False, rows_per_step=1, balanced=False),
    "packed_bal": dict(packed=True, rows_per_step=1, balanced=True),
    "accum8_bal": dict(packed=False, rows_per_step=8, balanced=True),
    # two GPUs (torchrun): FSDP2 data parallel, and expert parallel inside it; one packed row per GPU per step
    "dp2_bal": dict(packed=True, rows_per_step=2, balanced=True, nproc=2, ep=1),
    "dp2ep2_bal": dict(packed=True, rows_per_step=2, balanced=True, nproc=2, ep=2),
    # the precision-aware optimizer sharded by FSDP2 (bf16 params + int16 remainders, bf16 moments), as the seeds
    "dp2_pa_bal": dict(packed=True, rows_per_step=2, balanced=True, nproc=2, ep=1, precision_aware=True),
    "dp2ep2_pa_bal": dict(packed=True, rows_per_step=2, balanced=True, nproc=2, ep=2, precision_aware=True),
    "dp2ep2_pa_off_bal": dict(packed=True, rows_per_step=2, balanced=True, nproc=2, ep=2, precision_aware=True,
                              offload=0.5),
    # tensor / context parallel: the two ranks share one row (each holds half of its tokens)
    "tp2_pa_bal": dict(packed=True, rows_per_step=1, balanced=True, nproc=2, dp=1, tp=2, precision_aware=True),
    "cp2_pa_bal": dict(packed=True, rows_per_step=1, balanced=True, nproc=2, dp=1, cp=2, precision_aware=True),
    # four GPUs
    "dp4ep4_pa_bal": dict(packed=True, rows_per_step=4, balanced=True, nproc=4, ep=4, precision_aware=True),
    "dp4ep2_pa_bal": dict(packed=True, rows_per_step=4, balanced=True, nproc=4, ep=2, precision_aware=True),
    "tp2dp2ep4_pa_bal": dict(packed=True, rows_per_step=2, balanced=True, nproc=4, dp=2, tp=2, ep=4,
                             precision_aware=True),
    # one GPU, the knobs of the tuner: compiled blocks (_c), recompute none / selective, optimizer state offloaded
    # to host memory and streamed through the GPU for its update (_off05, _off10), or updated by the CPU (_hoff05)
    "single_bal_c": dict(packed=False, rows_per_step=1, balanced=True, compile=True),
    "single_nat_c": dict(packed=False, rows_per_step=1, balanced=False, compile=True),
    "packed_bal_c": dict(packed=True, rows_per_step=1, balanced=True, compile=True),
    "single_bal_none": dict(packed=False, rows_per_step=1, balanced=True, recompute="none"),
    "single_bal_c_none": dict(packed=False, rows_per_step=1, balanced=True, compile=True, recompute="none"),
    # FP8 row-wise products (models/common/fp8.py): experts and projections, or the experts alone
    "single_bal_c_fp8": dict(packed=False, rows_per_step=1, balanced=True, compile=True,
                             fp8=["experts", "projections"]),
    "single_bal_c_fp8x": dict(packed=False, rows_per_step=1, balanced=True, compile=True, fp8=["experts"]),
    "single_bal_c_none_fp8": dict(packed=False, rows_per_step=1, balanced=True, compile=True, recompute="none",
                                  fp8=["experts", "projections"]),
    "long32k_c_fp8": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                          loss_chunk=8192, steps=12, fp8=["experts", "projections"]),
    "single_nat_c_none": dict(packed=False, rows_per_step=1, balanced=False, compile=True, recompute="none"),
    "single_bal_c_sel": dict(packed=False, rows_per_step=1, balanced=True, compile=True, recompute="selective"),
    "single_bal_off05": dict(packed=False, rows_per_step=1, balanced=True, offload=0.5),
    "single_bal_off10": dict(packed=False, rows_per_step=1, balanced=True, offload=1.0),
    "single_bal_c_off05": dict(packed=False, rows_per_step=1, balanced=True, compile=True, offload=0.5),
    "single_bal_c_off10": dict(packed=False, rows_per_step=1, balanced=True, compile=True, offload=1.0),
    "accum8_bal_c": dict(packed=False, rows_per_step=8, balanced=True, compile=True),
    "accum8_bal_c_off05": dict(packed=False, rows_per_step=8, balanced=True, compile=True, offload=0.5),
    "accum8_bal_c_off10": dict(packed=False, rows_per_step=8, balanced=True, compile=True, offload=1.0),
    "single_bal_hoff05": dict(packed=False, rows_per_step=1, balanced=True, offload=0.5, offload_update="host",
                              steps=8),
    # Muse Spark Open at its real widths (hidden 8192, 64 heads of 128, latent 4096, expert FFN 4096, top-8), 4 layers
    # (layer 0 full attention, 1-3 sliding) and 16 experts: every token's active work per layer is the full model's
    "muse4l16e_bal": dict(packed=False, rows_per_step=1, balanced=True, model="muse-spark-open-816b-a42b",
                          overrides=MUSE_4L16E),
    "muse4l16e_bal_c": dict(packed=False, rows_per_step=1, balanced=True, model="muse-spark-open-816b-a42b",
                            overrides=MUSE_4L16E, compile=True),
    # DeepSeek-V3 at its real widths (MLA, a dense first layer, one shared expert, the group-limited sigmoid router),
    # 4 layers and 24 experts: every token's active work per layer is the full model's
    "dsv3_bal": dict(DSV3, recompute="full"),
    "dsv3_bal_none": dict(DSV3, recompute="none"),
    "dsv3_bal_c": dict(DSV3, recompute="full", compile=True),
    "dsv3_bal_c_none": dict(DSV3, recompute="none", compile=True),
    # LoRA rank 16 on q/k/v/o and every routed expert of a frozen bf16 base, beside full fine-tuning at the same shape
    "single_bal_c_lora": dict(packed=False, rows_per_step=1, balanced=True, compile=True, lora=True),
    "single_bal_c_none_lora": dict(packed=False, rows_per_step=1, balanced=True, compile=True, recompute="none",
                                   lora=True),
    # all 48 layers of Qwen3-30B-A3B under LoRA, compiled (one compiled block class for every layer)
    "lora48_bal_c": dict(packed=False, rows_per_step=1, balanced=True, compile=True, lora=True, layers=48, steps=12),
    "lora48_bal_c_none": dict(packed=False, rows_per_step=1, balanced=True, compile=True, lora=True, layers=48,
                              recompute="none", steps=12),
    "lora48_bal_c_experts": dict(packed=False, rows_per_step=1, balanced=True, compile=True, lora=True, layers=48,
                                 recompute="experts", steps=12),
    "lora48_bal_c_sel": dict(packed=False, rows_per_step=1, balanced=True, compile=True, lora=True, layers=48,
                             recompute="selective", steps=12),
    "lora48_bal_c_2rows": dict(packed=False, rows_per_step=2, rows_per_microbatch=2, balanced=True, compile=True,
                               lora=True, layers=48, steps=12),
    "lora48_bal_c_keep": dict(packed=False, rows_per_step=1, balanced=True, compile=True, lora=True, layers=48,
                              recompute="full_keep_attention", steps=12),
    # long rows: one document of 32K-128K tokens per row, compiled, the loss in chunks of 8,192 tokens; the attention
    # path and the recompute choice per variant
    "long32k_c": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768, loss_chunk=8192,
                      steps=12),
    "long32k_c_varlen": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                             loss_chunk=8192, attention="varlen", steps=12),
    "long32k_c_experts": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                              loss_chunk=8192, recompute="experts", steps=12),
    "long32k_c_none": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                           loss_chunk=8192, recompute="none", steps=12),
    "long32k_c_none_nochunk": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                                   recompute="none", steps=12),
    # full recompute that keeps the attention kernel's output (its forward runs once), with the chunked and fused loss
    "long32k_c_nochunk": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768, steps=12),
    "long32k_c_keep": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                           loss_chunk=8192, recompute="full_keep_attention", steps=12),
    "long32k_c_keep_nochunk": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                                   recompute="full_keep_attention", steps=12),
    "long32k_c_packed": dict(packed=True, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                             loss_chunk=8192, steps=12),
    # FlexAttention over packed documents (block mask from the documents' boundaries) against flash varlen (auto)
    "packed_bal_c_flex": dict(packed=True, rows_per_step=1, balanced=True, compile=True, attention="flex"),
    "long32k_c_packed_flex": dict(packed=True, rows_per_step=1, balanced=True, compile=True, row_tokens=32768,
                                  loss_chunk=8192, attention="flex", steps=12),
    "long64k_c": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=65536, loss_chunk=8192,
                      steps=8),
    "long128k_c": dict(packed=False, rows_per_step=1, balanced=True, compile=True, row_tokens=131072,
                       loss_chunk=8192, steps=8),
    # the 8-GPU seed layout's settings on 4 GPUs: all 48 layers, EP4 DP4, 16,384 tokens per GPU (2 rows)
    "seed48_dp4ep4_pa_bal": dict(packed=True, rows_per_step=8, rows_per_microbatch=2, balanced=True, nproc=4,
                                 ep=4, precision_aware=True, layers=48),
}


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]

PROFILED = ("dsv3_bal_c", "single_bal_c_fp8", "long32k_c", "long32k_c_none", "single_bal_c_lora", "single_bal_c_none_lora", "single_bal_c_none", "muse4l16e_bal_c", "single_bal", "single_bal_c", "single_bal_c_off05", "single_bal_hoff05", "dp2ep2_bal", "dp2ep2_pa_bal", "tp2_pa_bal", "cp2_pa_bal", "dp4ep4_pa_bal")


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


def run_variant(name: str, spec: dict, *, layers: int, steps: int, workdir: Path, device_type: str,
                memory_trace: bool = False, timeline: bool = False) -> dict:
    steps = spec.get("steps", steps)  # slow variants run fewer steps (window 5..steps-2)
    tiny = device_type == "cpu"
    model = spec.get("tiny_model", "qwen3-moe-tiny") if tiny else spec.get("model", "qwen3-30b-a3b")
    overrides = {} if tiny else spec.get("overrides", {"num_hidden_layers": spec.get("layers", layers)})
    row_tokens = 256 if tiny else spec.get("row_tokens", 8192)
    vocab = resolve_model_config(model, overrides=overrides).vocab_size  # the ids the model embeds
    rows_dir = write_rows(workdir / f"rows-{name}", rows=steps * spec["rows_per_step"], row_tokens=row_tokens,
                          vocab=vocab, packed=spec["packed"])
    nproc = spec.get("nproc", 1)
    tree = {
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
        **({"lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": LORA_TARGETS}} if spec.get("lora") else {}),
        **({"fp8": {"scaling": "rowwise", "targets": spec["fp8"]}} if spec.get("fp8") else {}),
        "debug": {"force_load_balance": spec["balanced"], "memory_trace": memory_trace,
                        "profile_step": steps - 1 if name in PROFILED else None, "profile_timeline": timeline},
    }
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
    window = tuple(spec["window"]) if "window" in spec else (5, min(19, steps - 2))
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
