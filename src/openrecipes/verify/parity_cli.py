"""``openrecipes verify parity HF_DIR``: the native model against transformers on a checkpoint."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from openrecipes.verify.cli import EXIT_STATUS


def register(checks: Any) -> None:
    parser = checks.add_parser(
        "parity",
        help="compare the native model with transformers on an HF checkpoint directory",
        description="Load HF_DIR with transformers' AutoModelForCausalLM and with openrecipes.from_hf, run the "
        "same random input ids, and compare logits, loss and every parameter gradient (max relative error). " + EXIT_STATUS,
    )
    parser.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence, 2 sequences (default: 32)")
    parser.add_argument("--dtype", choices=("fp32", "fp64", "bf16"), default="fp32",
                        help="precision both models load and run in (default: fp32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input ids")
    parser.add_argument("--logits-tolerance", type=float, default=1e-5, metavar="X",
                        help="max relative error of the logits (default: 1e-5)")
    parser.add_argument("--loss-tolerance", type=float, default=1e-5, metavar="X",
                        help="relative error of the loss (default: 1e-5)")
    parser.add_argument("--grad-tolerance", type=float, default=None, metavar="X",
                        help="max relative error of each gradient (default: 1e-4, or eight times the native "
                        "model's own fp32 rounding where that is more, measured against its fp64 gradient; a "
                        "value given here is the limit)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openrecipes.verify.parity import ParityThresholds, check_parity, format_parity, parity_dict

    grads = {} if args.grad_tolerance is None else {"grads": args.grad_tolerance, "grads_allow_rounding": False}
    thresholds = ParityThresholds(logits=args.logits_tolerance, loss=args.loss_tolerance, **grads)
    report = check_parity(args.hf_dir, tokens=args.tokens, dtype=args.dtype, seed=args.seed, thresholds=thresholds)
    if args.json:
        print(json.dumps(parity_dict(report), indent=2, default=_finite))
    else:
        print(format_parity(report))
    return 0 if report.passed else 1


def _finite(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)
