"""One results file from an `openrecipes tune --out` directory, for bench/results: the tuner's console log, its
trials and prunes, tune.json (with the figures the console, card and site quote), the family calibration, the card and
the tuned recipe, with the machine it ran on.

Usage: python bench/tune_bundle.py TUNE_OUT --start START.yaml --command "openrecipes tune ..." --log tune.log
       --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bundle(tune_out: Path, *, start: str, command: str, log: Path) -> dict:
    settings = tune_out / "tune.json"
    cards = sorted((tune_out / "recipes").rglob("*.yaml")) if (tune_out / "recipes").is_dir() else []
    card = next((c for c in cards if not c.name.endswith(".recipe.yaml")), None)
    tuned = tune_out / "tuned.yaml"
    calibration = tune_out / "calibration.json"
    return {
        "benchmark": "tune",
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "start": start,
        "command": command,
        "tune": json.loads(settings.read_text()) if settings.is_file() else None,
        "trials": _lines(tune_out / "trials.jsonl"),
        "pruned": _lines(tune_out / "pruned.jsonl"),
        "calibration": json.loads(calibration.read_text()) if calibration.is_file() else None,
        "card": card.read_text() if card else None,
        "tuned_recipe": tuned.read_text() if tuned.is_file() else None,
        "log": log.read_text() if log.is_file() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tune_out", type=Path)
    parser.add_argument("--start", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    record = bundle(args.tune_out, start=args.start, command=args.command, log=args.log)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
