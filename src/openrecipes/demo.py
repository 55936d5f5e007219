"""`openrecipes demo`: the main job on the embedded default, with no downloads and no GPU needed."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on the embedded default (no downloads)",
                                   description="List the registered models, then train the tiny Qwen3-MoE for a "
                                               "few steps on CPU (or the first GPU) and write a summary.")
    parser.add_argument("--out", default="demo-out", help="output directory (default: demo-out)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from openrecipes.models.cli import run as list_models
    from openrecipes.models.qwen3_moe import build_qwen3_moe
    from openrecipes.models.registry import get_config
    from openrecipes.utils import atomic_write_text

    if args.steps <= 0:
        raise ValueError(f"--steps must be positive, got {args.steps}")
    list_models(argparse.Namespace(json=False))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"\ntraining qwen3-moe-tiny for {args.steps} steps on {device} (random token rows)")
    config = get_config("qwen3-moe-tiny")
    model = build_qwen3_moe(config, device=device, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (4, 64), generator=generator).to(device)
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        logits = model(batch)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {step:3d}  loss {loss.item():.4f}  {time.perf_counter() - start:.2f} s")
    if not losses[-1] < losses[0]:
        raise RuntimeError(f"loss did not decrease: {losses}")
    out = Path(args.out)
    summary = {"model": "qwen3-moe-tiny", "device": device, "steps": args.steps, "losses": losses}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {out / 'summary.json'}")
    return 0
