"""The planner's peak memory and tokens/s/GPU (as the tuner sees them, before any refit) for the recipe of each run
directory given, beside its measured peak: one JSON line per run (the predictions of the hand grids at the tuner's
starts: bench/results/2026-12-03-tune22-grid-h200.json, bench/results/2026-12-04-d-allocator-h200.json).

Usage: python bench/tuning/predicted_peaks.py RUN_DIR... > predicted.jsonl"""

import json
import sys
from pathlib import Path

from openrecipes.config.rundir import RECIPE_FILE
from openrecipes.config.recipe import load_recipe
from openrecipes.tune.predict import Planner, Target

for run_dir in map(Path, sys.argv[1:]):
    if not (run_dir / RECIPE_FILE).is_file():
        continue
    recipe = load_recipe(run_dir / RECIPE_FILE)
    prediction = Planner(recipe, Target(count=1, gpu_type="H200"), 8192).predict(recipe)
    print(json.dumps({"run": run_dir.name, **prediction.to_dict()}))
