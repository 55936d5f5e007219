"""Trains several recipes one after another in this process (or each torchrun process), so a test of many layouts
at long rows pays for one launch: ``python -m tests.distributed.long_context_worker RUNS.json``, where RUNS.json is
a list of {"overrides": [...], "run_dir": ...} applied to the tiny Qwen3 SFT example (or to "example", a path), with
optional "stop_after" and "resume" as `train` takes them."""

import json
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"


def main(spec: Path) -> None:
    from openrecipes.config.recipe import load_recipe
    from openrecipes.train.loop import train

    torch.set_num_threads(1)
    for run in json.loads(spec.read_text()):
        recipe = load_recipe(run.get("example", EXAMPLE), [*run["overrides"], f"run_dir={run['run_dir']}"])
        train(recipe, command="long_context_worker", stop_after=run.get("stop_after"),
              resume=run.get("resume", False))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
