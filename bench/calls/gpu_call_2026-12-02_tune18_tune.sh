# One H200: the tuner from the 18-layer memory-bound start (bench/tune_h200_18l_start.yaml) within a 9.4-minute
# budget that includes verification, one interleaved remeasurement pair and the card; trials of 12 steps.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-02_tune18_tune.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
source bench/tune18_rows.sh
start=$(date +%s)
timeout 585 python3 -m openrecipes tune bench/tune_h200_18l_start.yaml --gpus 1xH200 --minutes 9.4 --trials 12 \
  --trial-steps 12 --remeasure 1 --out /tmp/tune > /tmp/tune.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" > $OUT/tune18_wall.json
tail -40 /tmp/tune.log; cp /tmp/tune.log $OUT/tune18.log
cp /tmp/tune/trials.jsonl $OUT/tune18_trials.jsonl; cp /tmp/tune/pruned.jsonl $OUT/tune18_pruned.jsonl
cp /tmp/tune/tuned.yaml $OUT/tune18_tuned.yaml; find /tmp/tune/recipes -name "*.yaml" -exec cp {} $OUT/tune18_card.yaml \;
