# One H200, call d (2026-12-04): the CUDA allocator's expandable segments against its default, where memory binds
# and where it does not. At the 22-layer start (bench/tune_h200_22l_start.yaml) the compiled 4-row microbatch at
# optimizer offload 0.1 (call v's grid best) under each allocator, interleaved twice, then under expandable segments
# offload 0.05 and 0 (the planner predicts 137 GiB allocated: without them it ran out in call v); then the peers'
# workload (bench/engine_speed.py single_bal, 8 layers) under each, interleaved. Each run a new process; the
# allocator is chosen by PYTORCH_CUDA_ALLOC_CONF here, before the recipe can say it. Measured peaks allocated and
# reserved per run. Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-04_d.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version.split()[0])"
source bench/tune18_rows.sh
four="--set layout.rows_per_microbatch=4 --set layout.max_tokens_per_gpu=32768 --set kernels.compile=true"
for variant in "c4-off0.1-caching|$four --set offload.fraction=0.1" "c4-off0.1-expandable|$four --set offload.fraction=0.1" \
               "c4-off0.1-caching-2|$four --set offload.fraction=0.1" "c4-off0.1-expandable-2|$four --set offload.fraction=0.1" \
               "c4-off0.05-expandable|$four --set offload.fraction=0.05" "c4-off0-expandable|$four --set offload.fraction=0"; do
  name=${variant%%|*}; sets=${variant#*|}
  case $name in *expandable*) alloc="expandable_segments:True";; *) alloc="";; esac
  left=$(( 400 - ($(date +%s) - T0) )); [ $left -lt 45 ] && break
  start=$(date +%s)
  PYTORCH_CUDA_ALLOC_CONF=$alloc timeout $(( left < 120 ? left : 120 )) python3 -m openrecipes train \
    bench/tune_h200_22l_start.yaml $sets --set run_dir=runs/grid-$name > /tmp/grid-$name.log 2>&1
  code=$?
  echo "{\"variant\": \"$name\", \"exit\": $code, \"wall_s\": $(( $(date +%s) - start ))}" | tee -a $OUT/grid_walls.jsonl
  python3 -m openrecipes measure runs/grid-$name --window 5 11 --json > /tmp/m-$name.json 2>/dev/null && \
    python3 -c "import json; d=json.load(open('/tmp/m-$name.json')); d['variant']='$name'; d['sets']='$sets'; print(json.dumps(d))" \
    >> $OUT/grid_measured.jsonl
  python3 bench/tune18_predicted.py runs/grid-$name >> $OUT/grid_predicted.jsonl 2>/dev/null
  grep -iE "out of memory|error" /tmp/grid-$name.log | tail -1 | cut -c1-200; echo "$name done at $(( $(date +%s) - T0 )) s"
done
python3 -c "
import json
for line in open('$OUT/grid_measured.jsonl'):
    d = json.loads(line); print(d['variant'], {k: d[k] for k in d if k in ('tokens_per_s_per_gpu', 'step_time_mean_s', 'step_time_cv', 'peak_memory_gib', 'peak_reserved_gib')})
" 2>&1 | cut -c1-250
for round in 1 2; do
  for alloc in caching expandable; do
    left=$(( 575 - ($(date +%s) - T0) )); [ $left -lt 60 ] && break 2
    conf=""; [ $alloc = expandable ] && conf="expandable_segments:True"
    PYTORCH_CUDA_ALLOC_CONF=$conf timeout $left python3 bench/engine_speed.py --variants single_bal \
      --out $OUT/speed-$alloc-$round.json > /tmp/speed-$alloc-$round.log 2>&1
    echo "speed $alloc $round exit $? at $(( $(date +%s) - T0 )) s"; tail -2 /tmp/speed-$alloc-$round.log | cut -c1-250
  done
done
echo "call took $(( $(date +%s) - T0 )) s"
