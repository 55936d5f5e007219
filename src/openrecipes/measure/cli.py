"""``openrecipes measure RUN_DIR``: tokens/s/GPU, MFU, cost and step-time spread of a run."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    from openrecipes.config.hardware import add_gpu_option

    parser = subparsers.add_parser(
        "measure",
        help="tokens/s/GPU, MFU, $/1M tokens and step-time CV of a run directory",
        description="Measure a run directory (run.json + metrics.jsonl) over a window of steps. "
        "Definitions: docs/measure.md.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by openrecipes train")
    parser.add_argument(
        "--window", nargs=2, type=int, metavar=("FIRST", "LAST"), default=None,
        help="first and last step of the window, inclusive, 0-based (default: 5 19, or 5 to the last step of a run "
             "shorter than 20 steps)",
    )
    add_gpu_option(parser, help="GPU type for the peak FLOP/s (default: run.json gpu.type)")
    price = parser.add_mutually_exclusive_group()
    price.add_argument("--usd-per-gpu-hour", type=float, metavar="P", help="price of one GPU-hour in USD")
    price.add_argument("--instance", metavar="NAME", help="take the price of this instance from the hardware table")
    parser.add_argument(
        "--hardware", action="append", metavar="FILE", default=[],
        help="YAML merged over the default hardware table (gpus / instances); may repeat",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openrecipes.measure.compute import measure_run_dir

    result = measure_run_dir(
        args.run_dir,
        window=tuple(args.window) if args.window else None,
        gpu_type=args.gpu,
        usd_per_gpu_hour=args.usd_per_gpu_hour,
        instance=args.instance,
        hardware_files=args.hardware,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result))
    return 0


def _or_dash(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(result: Any) -> str:
    first, last = result.window
    rows = [
        ("window", f"steps {first}-{last} ({result.window_steps} steps)"),
        ("window tokens", f"{result.window_tokens:,}"),
        ("window time", f"{result.window_time_s:,.3f} s"),
        ("GPUs", f"{result.gpus} x {result.gpu_type}"),
        ("tokens/s/GPU", f"{result.tokens_per_s_per_gpu:,.2f}"),
        ("step time mean", f"{result.step_time_mean_s:.4f} s"),
        ("step-time CV", f"{result.step_time_cv * 100:.2f} % (std {result.step_time_std_kind})"),
        ("active params N", _or_dash(result.active_params, ",")),
        ("peak FLOP/s/GPU", _or_dash(result.peak_flops_per_gpu and result.peak_flops_per_gpu / 1e12, ",.1f")
         + (" TFLOP/s (bf16 dense)" if result.peak_flops_per_gpu else "")),
        ("MFU (6N)", "-" if result.mfu is None else f"{result.mfu * 100:.1f} % ({result.mfu:.4f})"),
        ("model TFLOP/s/GPU", _or_dash(result.model_tflops_per_gpu, ",.1f")
         + (" (6N + causal attention)" if result.model_tflops_per_gpu is not None else "")),
        ("price", "-" if result.usd_per_gpu_hour is None
         else f"{result.usd_per_gpu_hour:g} USD/GPU-hour ({result.price_source})"),
        ("$ / 1M tokens", "-" if result.usd_per_million_tokens is None else f"${result.usd_per_million_tokens:.2f}"),
        ("GPU-hours", f"{result.gpu_hours:.2f} ({result.steps_recorded} steps, excludes startup)"),
        ("peak memory", "-" if result.peak_memory_gib is None else f"{result.peak_memory_gib:.1f} GiB"
         + ("" if result.peak_reserved_gib is None else f" allocated, {result.peak_reserved_gib:.1f} GiB reserved")),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
