"""`openrecipes models`: the registered model configs with their parameter counts."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models", help="list registered model configs with total and active parameters",
        description="List the registered model configs. Total = every parameter, frozen ones (Muse Spark's expert "
                    "bias) included. N = active parameters per token, excluding the input embedding and all norms "
                    "(router and LM head included): MFU uses 6·N.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def rows() -> list[dict]:
    from openrecipes.models.registry import get_config, names

    out = []
    for name in names():
        config = get_config(name)
        # config.total_params() counts the trainable parameters; the total adds the frozen ones
        trainable, frozen = config.total_params(), config.frozen_params()
        out.append({"name": name, "family": type(config).__name__, "layers": config.num_hidden_layers,
                    "total_params": trainable + frozen, "trainable_params": trainable, "frozen_params": frozen,
                    "active_params": config.active_params()})
    return out


def run(args: argparse.Namespace) -> int:
    table = rows()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    header = ("model", "family", "layers", "total params", "frozen", "active params N")
    body = [(r["name"], r["family"], str(r["layers"]), f"{r['total_params']:,}", f"{r['frozen_params']:,}",
             f"{r['active_params']:,}") for r in table]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    for i, row in enumerate([header, *body]):
        print("  ".join(cell.rjust(w) if i and j >= 2 else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
    return 0
