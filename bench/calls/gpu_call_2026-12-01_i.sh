# One H200, 2026-12-01, call i: search quality. A grid of six recipes around the 8-layer tuner start (recompute full /
# selective / none x 1 or 2 rows per microbatch) measured as --try trials, then a fresh tuner run from the same start
# with a third of the grid's trials (2: the start and the planner's first choice), 12-step trials, same rows
# (issue: tuner). Each tuner run is cut by its time limit once its trials are written (verification is not needed).
# Run from the repository root with .whl and h200-rows carried:  bash bench/calls/gpu_call_2026-12-01_i.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated*.whl .whl/typing_insp*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cp -r h200-rows/tune-rows tune-rows
R2="layout.max_tokens_per_gpu=16384 layout.rows_per_microbatch=2"
timeout 230 python3 -m openrecipes tune bench/tune_h200_start.yaml --gpus 1xH200 --minutes 3 --trials 6 \
  --trial-steps 12 --trial-timeout 90 --out /tmp/grid --try "recompute.granularity=selective" \
  --try "recompute.granularity=none" --try "$R2" --try "recompute.granularity=selective $R2" \
  --try "recompute.granularity=none $R2" 2>&1 | grep "trial" | tail -14
cp /tmp/grid/trials.jsonl $OUT/grid_trials.jsonl
timeout 150 python3 -m openrecipes tune bench/tune_h200_start.yaml --gpus 1xH200 --minutes 1.5 --trials 2 \
  --trial-steps 12 --trial-timeout 90 --out /tmp/search 2>&1 | grep "trial\|pruned" | tail -6
cp /tmp/search/trials.jsonl $OUT/search_trials.jsonl
ls $OUT
