# One H200, call r: the tuner of this tree (trials end early once stable, full_keep_attention in the space) from the
# 18-layer memory-bound start (bench/tune_h200_18l_start.yaml, rows of bench/tune18_rows.sh) within 8.8 minutes,
# verification, two remeasured pairs, ablations and the card included; trials of 12 steps. The hand grid of that
# start (call 1 of 2026-12-02): best 18,527 tokens/s/GPU.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-02_r.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
source bench/tune18_rows.sh
start=$(date +%s)
timeout 560 python3 -m openrecipes tune bench/tune_h200_18l_start.yaml --gpus 1xH200 --minutes 8.8 --trials 12 \
  --trial-steps 12 --remeasure 2 --out /tmp/tune > /tmp/tune.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" | tee $OUT/tune18_wall.json
tail -12 /tmp/tune.log | cut -c1-250; cp /tmp/tune.log $OUT/tune18.log
cp /tmp/tune/trials.jsonl $OUT/tune18_trials.jsonl
find /tmp/tune/recipes -name "*.yaml" -exec cp {} $OUT/ \; 2>/dev/null
