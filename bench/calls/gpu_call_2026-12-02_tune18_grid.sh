# One H200: the hand grid beside the tuner's 18-layer start (bench/tune_h200_18l_start.yaml): fractional optimizer
# offload with and without compiled blocks, 12 steps each (the tuner's trials: window 5-11), each run timed from
# process start to exit, measured, and its peak set beside the planner's prediction (bench/tune18_predicted.py).
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-02_tune18_grid.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
source bench/tune18_rows.sh
for variant in "0.3 true" "0.25 true" "0.35 true" "0.3 false" "0.5 false"; do
  set -- $variant; name=off$1-c$2
  start=$(date +%s)
  timeout 150 python3 -m openrecipes train bench/tune_h200_18l_start.yaml --set offload.fraction=$1 \
    --set kernels.compile=$2 --set run_dir=runs/grid-$name > /tmp/grid-$name.log 2>&1
  echo "{\"variant\": \"$name\", \"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" >> $OUT/grid_walls.jsonl
  tail -2 /tmp/grid-$name.log
  python3 -m openrecipes measure runs/grid-$name --window 5 11 --json > /tmp/m-$name.json 2>&1 && \
    python3 -c "import json,sys; d=json.load(open('/tmp/m-$name.json')); d['variant']='$name'; print(json.dumps(d))" >> $OUT/grid_measured.jsonl
done
python3 bench/tune18_predicted.py runs/grid-* > $OUT/grid_predicted.jsonl
