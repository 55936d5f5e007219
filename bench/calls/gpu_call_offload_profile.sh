# where a DP2-EP2 step with offload 0.5 spends its time (host-side profile of step 3)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/typing_extensions*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=16
python3 - <<'PY'
import sys, yaml, os
sys.path.insert(0, "bench")
from pathlib import Path
from engine_speed import write_rows
out = Path(os.environ["OUT"])
write_rows(Path("/tmp/rows"), rows=8, row_tokens=8192, vocab=151936, packed=True)
tree = {"name": "offload-profile", "model": "qwen3-30b-a3b", "model_overrides": {"num_hidden_layers": 8},
        "data": {"rows": "/tmp/rows"}, "layout": {"max_tokens_per_gpu": 8192, "dp": 2, "ep": 2},
        "offload": {"fraction": 0.5}, "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1},
        "optimizer": {"lr": 1e-5, "precision_aware": True, "moment_dtype": "bf16", "grad_clip": 1.0},
        "precision": "bf16", "steps": 4, "global_batch": 2, "seed": 0, "run_dir": str(out / "run"),
        "checkpoint": {"at_end": False}, "logging": {"progress": False}, "debug": {"force_load_balance": True,
                                                                   "profile_step": 3, "profile_sort": "cpu_time_total"}}
Path("/tmp/recipe.yaml").write_text(yaml.safe_dump(tree))
PY
timeout 190 python3 -m openrecipes train /tmp/recipe.yaml --nproc 2 2>&1 | tail -3
head -c 9000 $OUT/run/profile.txt
