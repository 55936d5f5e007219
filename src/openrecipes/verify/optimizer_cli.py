"""``openrecipes verify optimizer``: the optimizer component test of the recipe cards."""

from __future__ import annotations

import argparse
import json
from typing import Any

from openrecipes.config.cli_numbers import at_least, positive
from openrecipes.verify.cli import EXIT_STATUS


def register(checks: Any) -> None:
    parser = checks.add_parser(
        "optimizer",
        help="precision-aware Adam (on the device and offloaded) against an FP64 reference on one MoE layer",
        description="Component test: one MoE layer, every optimizer arm against an FP64 AdamW reference; worst "
        "tensor relative L2 error after the checked steps against bound = 2 x the default optimizer's error + "
        "1e-3; three negative controls must fail; remainder masters must equal explicit FP32 masters bitwise. " + EXIT_STATUS,
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the candidate arms run")
    for name, help_text in (("hidden", "hidden size"), ("experts", "expert count"), ("top-k", "experts per token"),
                            ("ffn", "expert FFN width"), ("tokens", "tokens per step")):
        parser.add_argument(f"--{name}", type=int, default=None, metavar="N",
                            help=f"{help_text} (default: the device's shape)")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 3], metavar="S",
                        help="steps after which errors are checked (default: 1 3)")
    parser.add_argument("--lr", type=positive(float), default=None, help="learning rate (default: 1.8e-3)")
    parser.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"),
                        help="Adam betas (default: 0.9 0.98)")
    parser.add_argument("--eps", type=positive(float), default=None, help="Adam eps (default: 1e-8)")
    parser.add_argument("--weight-decay", type=at_least(float, 0), default=None,
                        help="decoupled weight decay (default: 0.1)")
    parser.add_argument("--compute", choices=("fp64", "bf16"), default="fp64",
                        help="precision of the mixed-precision arms' forward and backward (default: fp64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the layer's weights and tokens")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch

    from openrecipes.verify.optimizer import CPU_SHAPE, CUDA_SHAPE, Hyper, run_component_test

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    shape = CPU_SHAPE if args.device == "cpu" else CUDA_SHAPE
    shape = replace(shape, **{name: getattr(args, name) for name in ("hidden", "experts", "top_k", "ffn", "tokens")
                              if getattr(args, name) is not None})
    hyper = Hyper()
    given = {"lr": args.lr, "eps": args.eps, "weight_decay": args.weight_decay,
             "betas": tuple(args.betas) if args.betas else None}
    hyper = replace(hyper, **{k: v for k, v in given.items() if v is not None})
    report = run_component_test(shape=shape, hyper=hyper, checkpoints=tuple(args.steps), device=args.device,
                                seed=args.seed, compute=args.compute)
    if args.json:
        print(json.dumps(report_dict(report), indent=2))
    else:
        print(format_report(report))
    return 0 if report.passed else 1


def _worst(report, *, role: str, offloaded: bool | None = None):
    arms = [a for a in report.arms if a.role == role
            and (offloaded is None or (a.offload_fraction > 0) == offloaded)]
    return {s: max(arms, key=lambda a: a.errors[s]) for s in report.checkpoints} if arms else {}


def summary_line(report) -> str:
    """One sentence shaped like the component-test line of a recipe card."""
    device_arms, offloaded_arms = _worst(report, role="candidate", offloaded=False), \
        _worst(report, role="candidate", offloaded=True)
    parts = []
    for i, step in enumerate(report.checkpoints):
        when = f"after {'one step' if step == 1 else 'three steps' if step == 3 else f'{step} steps'}"
        worst = device_arms[step].worst[step] if device_arms else "-"
        on_device = f"{device_arms[step].errors[step]:.3g}" if device_arms else "n/a"
        offloaded = f"{offloaded_arms[step].errors[step]:.3g}" if offloaded_arms else "n/a"
        if i == 0:
            parts.append(f"worst tensor ({_kind(worst)}: {worst}) relative L2 error {on_device} on the "
                         f"{report.device} and {offloaded} offloaded against a bound of {report.bounds[step]:.2e} "
                         f"{when}")
        else:
            parts.append(f"{on_device} and {offloaded} against {report.bounds[step]:.2e} {when}")
    bitwise = all(t["bitwise_equal"] for t in report.self_tests)
    controls = [a for a in report.arms if a.role == "control"]
    failed = sum(a.ok for a in controls)
    text = ", and ".join(parts) + " (bound 2 x the default optimizer's error + 1e-3); "
    text += ("reconstructed FP32 masters bitwise identical to an arm with explicit FP32 masters"
             if bitwise else "reconstructed FP32 masters DIFFER from the arm with explicit FP32 masters")
    text += (f" and the {len(controls)} negative controls fail" if failed == len(controls)
             else f"; only {failed} of {len(controls)} negative controls fail")
    return text


def _kind(name: str) -> str:
    from openrecipes.verify.optimizer import tensor_kind

    return tensor_kind(name)


def format_report(report) -> str:
    s = report.shape
    lines = [f"optimizer component test: {'PASS' if report.passed else 'FAIL'}",
             f"shape: one MoE layer: hidden {s.hidden}, {s.experts} experts, top-{s.top_k}, expert FFN {s.ffn}, "
             f"EP 1, {s.tokens} tokens; device {report.device}; forward/backward of bf16 arms in {report.compute}",
             f"hyperparameters: lr {report.hyper.lr:g}, betas {report.hyper.betas}, eps {report.hyper.eps:g}, "
             f"weight decay {report.hyper.weight_decay:g}",
             "", summary_line(report), ""]
    header = f"{'arm':58} {'role':9} " + " ".join(f"{'step ' + str(st):>10} {'bound':>8}" for st in
                                                     report.checkpoints) + "  worst tensor (last step)  verdict"
    lines.append(header)
    for a in report.arms:
        cells = " ".join(f"{a.errors[st]:10.3e} {report.bounds[st]:8.2e}" for st in report.checkpoints)
        verdict = {"control": "fails (ok)" if a.ok else "PASSES (bad)"}.get(a.role, "pass" if a.ok else "FAIL")
        last = report.checkpoints[-1]
        lines.append(f"{a.name:58} {a.role:9} {cells}  {a.worst[last]:24}  {verdict}")
    lines.append("")
    for t in report.self_tests:
        state = "bitwise equal" if t["bitwise_equal"] else f"DIFFER in {t['mismatched_tensors']}"
        lines.append(f"remainder self-test ({t['moment_dtype']} moments, same gradients): {state}")
    return "\n".join(lines)


def report_dict(report) -> dict:
    from dataclasses import asdict

    steps = [str(s) for s in report.checkpoints]
    return {
        "passed": report.passed,
        "summary": summary_line(report),
        "device": report.device,
        "compute": report.compute,
        "shape": dict(asdict(report.shape), ep=1),
        "hyperparameters": dict(asdict(report.hyper), betas=list(report.hyper.betas)),
        "steps": report.checkpoints,
        "bounds": dict(zip(steps, (report.bounds[s] for s in report.checkpoints))),
        "arms": [{"name": a.name, "role": a.role, "offload_fraction": a.offload_fraction, "ok": a.ok,
                  "errors": {str(s): a.errors[s] for s in report.checkpoints},
                  "worst_tensor": {str(s): a.worst[s] for s in report.checkpoints},
                  "worst_kind": {str(s): _kind(a.worst[s]) for s in report.checkpoints},
                  "within_bound": {str(s): a.within_bound[s] for s in report.checkpoints}} for a in report.arms],
        "self_tests": report.self_tests,
    }
