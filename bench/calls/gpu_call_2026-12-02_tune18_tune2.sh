# One H200: the tuner from the 18-layer memory-bound start (bench/tune_h200_18l_start.yaml) within an 8.6-minute
# budget that includes verification, two interleaved remeasurement pairs and the card; trials of 12 steps. Before
# it: the GPU tests of the pinned optimizer state and its allocation time (bench/pinned_state_alloc.py, 6 layers).
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-02_tune18_tune2.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pinned_state.py tests/gpu/test_fused_adam.py \
  > $OUT/gpu_tests.txt 2>&1 &
source bench/tune18_rows.sh
wait; tail -3 $OUT/gpu_tests.txt
timeout 60 python3 bench/pinned_state_alloc.py bench/tune_h200_18l_start.yaml openrecipes 6 >> $OUT/pinned.jsonl 2>&1
start=$(date +%s)
timeout 545 python3 -m openrecipes tune bench/tune_h200_18l_start.yaml --gpus 1xH200 --minutes 8.6 --trials 12 \
  --trial-steps 12 --remeasure 2 --out /tmp/tune > /tmp/tune.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" > $OUT/tune18_wall.json
tail -40 /tmp/tune.log; cp /tmp/tune.log $OUT/tune18.log
cp /tmp/tune/trials.jsonl $OUT/tune18_trials.jsonl; cp /tmp/tune/pruned.jsonl $OUT/tune18_pruned.jsonl
cp /tmp/tune/tuned.yaml $OUT/tune18_tuned.yaml 2>/dev/null
find /tmp/tune/recipes -name "*.yaml" -exec cp {} $OUT/ \; 2>/dev/null
cp /tmp/tune/verify/optimizer.json $OUT/tune18_optimizer.json 2>/dev/null
ls -la --time-style=+%T /tmp/tune/verify/ /tmp/tune/trials/*/ > $OUT/tune18_files.txt 2>&1
