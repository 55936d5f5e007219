# One H200, call v: the hand grid at the 22-layer start (bench/tune_h200_22l_start.yaml), each run a new
# `openrecipes train` process of 12 steps measured over steps 5-11, with Dynamo's recompile log (packed rows):
# 4 rows per microbatch compiled without offload (the planner says it does not fit), with optimizer offload 0.1, 0.2,
# 0.25 (the fraction the tuner solves), 0.3 with full_keep_attention (the planner's first), and one row per
# microbatch compiled at 0.25; then the GPU tests of compiled blocks with the time left.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-03_v.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version.split()[0])"
source bench/tune18_rows.sh
four="--set layout.rows_per_microbatch=4 --set layout.max_tokens_per_gpu=32768 --set kernels.compile=true"
for variant in "c4-off0.25|$four --set offload.fraction=0.25" "c4-off0|$four --set offload.fraction=0" \
               "c4-off0.1|$four --set offload.fraction=0.1" "c4-off0.2|$four --set offload.fraction=0.2" \
               "c4-off0.3-keep|$four --set offload.fraction=0.3 --set recompute.granularity=full_keep_attention" \
               "c1-off0.25|--set kernels.compile=true --set offload.fraction=0.25"; do
  name=${variant%%|*}; sets=${variant#*|}
  left=$(( 520 - ($(date +%s) - T0) )); [ $left -lt 45 ] && break
  start=$(date +%s)
  TORCH_LOGS=recompiles timeout $(( left < 120 ? left : 120 )) python3 -m openrecipes train \
    bench/tune_h200_22l_start.yaml $sets --set run_dir=runs/grid-$name > /tmp/grid-$name.log 2>&1
  code=$?
  echo "{\"variant\": \"$name\", \"exit\": $code, \"wall_s\": $(( $(date +%s) - start )), \"recompiles\": $(grep -c 'Recompiling function' /tmp/grid-$name.log)}" | tee -a $OUT/grid_walls.jsonl
  grep -A3 "Recompiling function" /tmp/grid-$name.log | grep -E "    - " | sort | uniq -c | head -5 | cut -c1-250
  python3 -m openrecipes measure runs/grid-$name --window 5 11 --json > /tmp/m-$name.json 2>/dev/null && \
    python3 -c "import json; d=json.load(open('/tmp/m-$name.json')); d['variant']='$name'; d['sets']='$sets'; print(json.dumps(d))" \
    >> $OUT/grid_measured.jsonl
  python3 bench/tune18_predicted.py runs/grid-$name >> $OUT/grid_predicted.jsonl 2>/dev/null
  grep -iE "out of memory|error" /tmp/grid-$name.log | tail -1 | cut -c1-200; echo "$name done at $(( $(date +%s) - T0 )) s"
done
python3 -c "
import json
for line in open('$OUT/grid_measured.jsonl'):
    d = json.loads(line); print(d['variant'], {k: d[k] for k in d if k in ('tokens_per_s_per_gpu', 'step_time_mean_s', 'step_time_cv', 'peak_memory_gib')})
" 2>&1 | cut -c1-250
left=$(( 585 - ($(date +%s) - T0) ))
[ $left -gt 40 ] && timeout $left python3 -m pytest tests/gpu/test_compile_gpu.py -p no:cacheprovider -rA 2>&1 | \
  tail -8 | tee $OUT/gpu_test.txt
echo "call took $(( $(date +%s) - T0 )) s"
