"""The optimizer component test of the recipe cards on CUDA, at the seed layer's shape, written as JSON.

Usage: python bench/component_test.py --out DATE-component_test-h200.json [--experts 64]
       [--compute fp64|bf16] [any option of `openrecipes verify optimizer`]

Default shape: hidden 4096, 64 experts (one rank's share of the seed's 512 under EP 8; EP itself is not run),
top-10, expert FFN 1024, 4,096 tokens. Exit status: that of the component test.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from openrecipes.utils import atomic_write_text  # noqa: E402
from openrecipes.verify import optimizer_cli  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    own, rest = parser.parse_known_args()
    # the options of `openrecipes verify optimizer`, parsed by its own parser
    checks = argparse.ArgumentParser(prog="component_test.py").add_subparsers(dest="check")
    optimizer_cli.register(checks)
    args = checks.choices["optimizer"].parse_args(["--device", "cuda", *rest])

    from dataclasses import replace

    import torch

    from openrecipes.verify.optimizer import CUDA_SHAPE, Hyper, run_component_test

    shape = replace(CUDA_SHAPE, **{k: getattr(args, k) for k in ("hidden", "experts", "top_k", "ffn", "tokens")
                                   if getattr(args, k) is not None})
    hyper = replace(Hyper(), **{k: v for k, v in {"lr": args.lr, "eps": args.eps, "weight_decay": args.weight_decay,
                                                  "betas": tuple(args.betas) if args.betas else None}.items()
                                if v is not None})
    start = time.time()
    report = run_component_test(shape=shape, hyper=hyper, checkpoints=tuple(args.steps), device="cuda",
                                seed=args.seed, compute=args.compute)
    result = optimizer_cli.report_dict(report)
    result["environment"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                             "cuda": torch.version.cuda, "python": platform.python_version(),
                             "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                             "wall_seconds": time.time() - start}
    atomic_write_text(own.out, json.dumps(result, indent=2) + "\n")
    print(optimizer_cli.format_report(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
