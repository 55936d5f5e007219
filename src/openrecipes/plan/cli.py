"""``openrecipes plan``: predict peak memory per stage, fit, tokens/s/GPU and MFU before a run."""

from __future__ import annotations

import argparse
import json
from typing import Any

_LAYOUT_OPTIONS = ("tp", "pp", "pp_first_stage_layers", "pp_last_stage_layers", "cp", "ep", "etp", "dp")
_SWEEP_TOKENS = (4096, 8192, 16384)
_SWEEP_OFFLOAD = (0.0, 0.5, 1.0)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="predict memory and throughput of a layout, or rank layouts",
                              description=__doc__)
    p.add_argument("model", help="registered model name (see `openrecipes models`)")
    p.add_argument("--gpus", required=True, help="COUNTxTYPE, e.g. 8xH200")
    p.add_argument("--gpu-memory-gib", type=float, help="override the GPU memory in GiB")
    for name in _LAYOUT_OPTIONS:
        p.add_argument("--" + name.replace("_", "-"), type=int, dest=name,
                       help=f"layout {name}; any layout flag plans that one layout (the others default to 1 or an "
                            "even split), none ranks every layout that fits")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="sequence parallelism with tp > 1 (plans one layout)")
    p.add_argument("--max-tokens-per-gpu", type=int,
                   help="tokens per GPU per microbatch (default: 8192 for one layout; a ranking tries "
                        f"{', '.join(map(str, _SWEEP_TOKENS))})")
    p.add_argument("--rows-per-microbatch", type=int,
                   help="rows per microbatch (default: as many as --max-tokens-per-gpu holds)")
    p.add_argument("--recompute", choices=["none", "selective", "full", "attention_core", "experts"],
                   help="activation recompute (default: full for one layout; a ranking tries none, selective and "
                        "full)")
    p.add_argument("--optimizer", choices=["adam", "precision-aware"],
                   help="optimizer state (default: adam for one layout; a ranking tries both)")
    p.add_argument("--offload-fraction", type=float,
                   help="share of the optimizer state kept on the CPU (default: 0 for one layout; a ranking tries "
                        f"{', '.join(map(str, _SWEEP_OFFLOAD))})")
    p.add_argument("--global-batch-tokens", type=int, default=128 * 8192,
                   help="tokens per optimizer step (default 128 rows x 8192)")
    p.add_argument("--engine", choices=["megatron", "openrecipes"], default="megatron",
                   help="whose memory and speed to predict: Megatron-LM's (as in the seed cards; default) or this "
                        "engine's (FSDP2 sharding; speed calibrated on our H200 runs; a search ranks only the "
                        "layouts it can run)")
    p.add_argument("--hardware", help="planner YAML: efficiencies and overheads, optionally extra gpus entries (default: the packaged plan/planner.yaml)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranking to show")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openrecipes.models.registry import get_config
    from openrecipes.config.layout import LayoutConfig
    from openrecipes.plan.enumerate import evaluate, search
    from openrecipes.plan.hardware import load_hardware, parse_gpus
    from openrecipes.plan.memory import TrainingSetup
    from openrecipes.plan.shape import model_shape

    count, gpu_type = parse_gpus(args.gpus)
    hw = load_hardware(gpu_type, path=args.hardware, memory_gib=args.gpu_memory_gib)
    shape = model_shape(get_config(args.model), name=args.model)
    if args.top < 1:
        raise ValueError(f"--top: must be at least 1, got {args.top}")
    given = {k: getattr(args, k) for k in _LAYOUT_OPTIONS if getattr(args, k) is not None}
    if given or args.sequence_parallel:
        tp, pp, cp = given.get("tp", 1), given.get("pp", 1), given.get("cp", 1)
        if "dp" not in given:
            if count % (tp * pp * cp):
                raise ValueError(f"--dp: {count} GPUs are not a multiple of tp*pp*cp = {tp * pp * cp}")
            given["dp"] = count // (tp * pp * cp)
        layout = LayoutConfig(**given, sequence_parallel=bool(args.sequence_parallel),
                              max_tokens_per_gpu=args.max_tokens_per_gpu or 8192,
                              rows_per_microbatch=args.rows_per_microbatch)
        if layout.world_size != count:
            raise ValueError(f"dp: tp*pp*cp*dp = {layout.world_size} must equal --gpus count {count}")
        setup = TrainingSetup(recompute=args.recompute or "full", optimizer=args.optimizer or "adam",
                              offload_fraction=args.offload_fraction or 0.0,
                              global_batch_tokens=args.global_batch_tokens, engine=args.engine)
        plan = evaluate(shape, layout, setup, hw)
        if args.json:
            print(json.dumps(plan.to_json(), indent=2))
        else:
            _print_plan(plan, shape.name, hw.gpu.name)
        return 0
    plans, evaluated = search(
        shape, count, hw,
        max_tokens=[args.max_tokens_per_gpu] if args.max_tokens_per_gpu else _SWEEP_TOKENS,
        recompute=[args.recompute] if args.recompute else ["none", "selective", "full"],
        optimizers=[args.optimizer] if args.optimizer else ["adam", "precision-aware"],
        offloads=[args.offload_fraction] if args.offload_fraction is not None else _SWEEP_OFFLOAD,
        global_batch_tokens=args.global_batch_tokens, engine=args.engine)
    top = plans[:args.top]
    if args.json:
        print(json.dumps({"evaluated": evaluated, "fitting": len(plans),
                          "ranked": [p.to_json() for p in top]}, indent=2))
        return 0
    print(f"{shape.name} on {count}x{hw.gpu.name} ({hw.gpu.memory_gib} GiB): {evaluated} valid layout settings, "
          f"{len(plans)} fit; best {len(top)} by predicted tokens/s/GPU ({_basis(args.engine)})")
    header = f"{'#':>3}  {'layout':<32} {'tok/GPU':>7} {'recompute':<9} {'optimizer':<15} {'offl':>4} " \
             f"{'peak GiB':>8} {'tok/s/GPU':>10} {'MFU':>6}"
    print(header)
    for rank, p in enumerate(top, 1):
        print(f"{rank:>3}  {p.layout.label():<32} {p.layout.max_tokens_per_gpu:>7} {p.setup.recompute:<9} "
              f"{p.setup.optimizer:<15} {p.setup.offload_fraction:>4.1f} {p.peak_memory_gib:>8.1f} "
              f"{p.throughput.tokens_per_s_per_gpu:>10.1f} {p.throughput.mfu:>6.1%}")
    return 0


def _print_plan(plan: Any, model: str, gpu: str) -> None:
    from openrecipes.config.layout import unsupported_reason

    t = plan.throughput
    print(f"{model} on {plan.layout.world_size}x{gpu}: {plan.layout.label()}, {plan.layout.max_tokens_per_gpu} "
          f"tokens/GPU, recompute {plan.setup.recompute}, {plan.setup.optimizer}, offload "
          f"{plan.setup.offload_fraction}")
    print(f"{'stage':>5} {'layers':>6} {'in flight':>9} {'allocated GiB':>13} {'peak GiB':>9}")
    for s in plan.stages:
        print(f"{s.stage:>5} {s.layers:>6} {s.inflight_microbatches:>9} {s.allocated_gib:>13.1f} "
              f"{s.reserved_gib:>9.1f}")
    host = max(plan.stages, key=lambda s: s.host_gib)
    print(f"host memory per rank (stage {host.stage}): {host.host_gib:.1f} GiB ("
          + ", ".join(f"{k} {v:.1f}" for k, v in host.host_parts_gib.items()) + ")")
    verdict = "fits" if plan.fits else "does NOT fit"
    print(f"peak {plan.peak_memory_gib:.1f} GiB of {plan.capacity_gib} GiB: {verdict}")
    print(f"predicted {t.tokens_per_s_per_gpu:.1f} tokens/s/GPU, MFU {t.mfu:.1%}, step {t.step_time_s:.2f} s, "
          f"{t.microbatches} microbatches, bubble {t.bubble_fraction:.1%} ({_basis(plan.setup.engine)})")
    if plan.setup.engine == "openrecipes":
        reason = unsupported_reason(plan.layout)
        if reason:
            print(f"openrecipes train cannot run this layout yet: {reason}")


def _basis(engine: str) -> str:
    if engine == "openrecipes":
        return "estimates; this engine's TP/CP/offload costs fitted to our H200 runs, see docs/plan.md"
    return "estimates, not calibrated for Megatron-LM"
