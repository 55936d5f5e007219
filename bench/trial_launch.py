"""What a one-process trial costs started as a new process (cold) and forked from the tuner's warm process
(tune/zygote.py): the same 8-step trial of a start recipe, run alternately cold and warm, each with its wall time, the
phases before its first step (startup.json) and its mean step time. Results as JSON lines on stdout.

Usage: python bench/trial_launch.py START.yaml ROWS_DIR OUT_DIR [PAIRS]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from openrecipes.config.rundir import read_startup
from openrecipes.tune.runner import LocalRunner, TrialRun


def main(start: Path, rows: Path, out: Path, pairs: int = 3) -> None:
    tree = yaml.safe_load(start.read_text())
    runners = {"cold": LocalRunner(warm=False, poll_s=0.1), "warm": LocalRunner(warm=True, poll_s=0.1)}
    for index in range(pairs):
        for kind, runner in runners.items():
            trial_dir = out / f"{index}-{kind}"
            trial_dir.mkdir(parents=True)
            recipe = {**tree, "steps": 8, "data": {"rows": str(rows.resolve())},
                      "run_dir": str((trial_dir / "run").resolve()), "logging": {"progress": False}}
            (trial_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
            trial = TrialRun(recipe_path=trial_dir / "recipe.yaml", run_dir=trial_dir / "run", nproc=1,
                             timeout_s=300, window=(2, 7), steps=8)  # stopped at its last step, as the tuner's are
            outcome = runner.run(trial)
            print(json.dumps({"pair": index, "kind": kind, "ok": outcome.ok, "detail": outcome.detail,
                              "wall_s": round(outcome.wall_s, 3), "startup_s": read_startup(trial.run_dir),
                              "step_time_mean_s": (outcome.measured or {}).get("step_time_mean_s")}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), *(int(a) for a in sys.argv[4:5]))
