"""A tuner benchmark's results JSON from what the tuner wrote (its trials.jsonl and tune.log under OUT, as a call's
tune.tgz brings them back): each trial's phase, changes, measured and predicted throughput and peak, wall time, time
outside its steps, start-up phases and its wall time over its steps, and the command's gain line.

Usage: python bench/tune_results.py OUT NAME CALL START COMMAND BUDGET_S COMMAND_WALL_S > RESULTS.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def trial_row(record: dict, trial_steps: int) -> dict:
    measured, predicted = record.get("measured") or {}, record.get("prediction") or {}
    # the steps it ran: all, or up to its window's end when it ended once stable (tune/trial.steps_run)
    steps = min(trial_steps, measured["window"][1] + 1) if measured.get("window") else trial_steps
    steps_s = steps * measured["step_time_mean_s"] if measured else None
    return {"trial": record["index"] + 1, "phase": record["phase"], "changes": record["label"],
            "status": record["status"], "failure": (record.get("failure") or {}).get("class"),
            "tokens_per_s_per_gpu": measured.get("tokens_per_s_per_gpu"),
            "predicted_tokens_per_s_per_gpu": predicted.get("calibrated_tokens_per_s_per_gpu"),
            "peak_memory_gib": measured.get("peak_memory_gib"),
            "predicted_allocated_gib": predicted.get("calibrated_allocated_gib"),
            "steps_run": steps if measured else None,
            "wall_s": record["wall_s"], "outside_steps_s": None if steps_s is None else record["wall_s"] - steps_s,
            "wall_over_steps": None if not steps_s else record["wall_s"] / steps_s,
            "startup_s": record.get("startup_s")}


def main(out: Path, name: str, call: str, start: str, command: str, budget_s: float, wall_s: float) -> None:
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines() if line.strip()]
    settings = json.loads((out / "tune.json").read_text())
    summary = [line for line in (out / "tune.log").read_text().splitlines() if line.startswith("openrecipes tune:")]
    print(json.dumps({"benchmark": name, "gpu": "NVIDIA H200", "call": call, "start": start, "command": command,
                      "budget_s": budget_s, "command_wall_s": wall_s, "summary": summary[-1] if summary else None,
                      "out_of_memory_trials": sum((r.get("failure") or {}).get("class") == "out_of_memory"
                                                  for r in records),
                      "trials": [trial_row(r, settings["trial_steps"]) for r in records]}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6]),
         float(sys.argv[7]))
