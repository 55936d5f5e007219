# One H200, call l: the tuner from the 18-layer memory-bound start (bench/tune_h200_18l_start.yaml) after the planner
# learned the memory knobs (compiled blocks' fused loss and saved tensors, the loss beside gradient accumulators;
# bench/results/2026-12-02-memory-knobs-h200.json), within 8.6 minutes that include verification, remeasurement and
# the card; every output of the tuner comes back in one archive (trials.jsonl with each trial's predicted and measured
# peak). Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-02_l.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
source bench/tune18_rows.sh
start=$(date +%s)
timeout 545 python3 -m openrecipes tune bench/tune_h200_18l_start.yaml --gpus 1xH200 --minutes 8.6 --trials 12 \
  --trial-steps 12 --remeasure 2 --out runs/tune18 > $OUT/tune18.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" | tee $OUT/tune18_wall.json
tail -45 $OUT/tune18.log
tar czf $OUT/tune18.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='checkpoints' runs/tune18 2>/dev/null
ls -la $OUT
