# One H200, call f (2026-12-04): the 8-layer search-quality start of call i (bench/tune_h200_start.yaml, the same 24
# pretraining rows, built here) on the tuner of this tree, as call q ran it (6.5 minutes, whole command: search,
# verification, one remeasured pair, ablations and the card). Call i's grid: best 50,058; call q's winner 50,912.
# Everything it wrote but the trial run directories comes back as tune8.tgz. Then, as time allows, the 22-layer start's
# grid best (call d: compiled, 4 rows, offload 0, 21,035) and call e's winner (offload 0.05) interleaved.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-04_f.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 bench/h200_rows.py /tmp/in8 250
timeout 60 python3 -m openrecipes data build /tmp/in8/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out tune-rows 2>&1 | tail -1
echo "rows done at $(( $(date +%s) - T0 )) s"
start=$(date +%s)
timeout 420 python3 -m openrecipes tune bench/tune_h200_start.yaml --gpus 1xH200 --minutes 6.5 --trials 10 \
  --trial-steps 12 --remeasure 1 --out /tmp/tune8 > /tmp/tune8.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" | tee $OUT/tune_wall.json
cp /tmp/tune8.log /tmp/tune8/tune.log
tar -czf $OUT/tune8.tgz --exclude='run' --exclude='*.safetensors' --exclude='rows' -C /tmp tune8 2>/dev/null
tail -30 /tmp/tune8.log | cut -c1-250
python3 bench/h200_rows.py /tmp/tune18-in 400
timeout 60 python3 -m openrecipes data build /tmp/tune18-in/docs.jsonl --format pretrain --row-tokens 8192 --rows 48 \
  --no-progress --out tune22-rows 2>&1 | tail -1
four="--set data.rows=tune22-rows --set layout.rows_per_microbatch=4 --set layout.max_tokens_per_gpu=32768 --set kernels.compile=true"
for name in off0-1 off0.05-1 off0-2 off0.05-2; do
  fraction=${name#off}; fraction=${fraction%-*}
  left=$(( 585 - ($(date +%s) - T0) )); [ $left -lt 50 ] && break
  timeout $(( left < 90 ? left : 90 )) python3 -m openrecipes train bench/tune_h200_22l_start.yaml $four \
    --set offload.fraction=$fraction --set run_dir=runs/pair-$name > /tmp/pair-$name.log 2>&1
  echo "{\"run\": \"$name\", \"exit\": $?}" >> $OUT/pair_exits.jsonl
  python3 -m openrecipes measure runs/pair-$name --window 5 11 --json > /tmp/m.json 2>/dev/null && python3 -c "
import json; d = json.load(open('/tmp/m.json')); print(json.dumps({'run': '$name', 'offload': $fraction, **{k: d.get(k) for k in
  ('tokens_per_s_per_gpu', 'step_time_mean_s', 'step_time_cv', 'peak_memory_gib', 'peak_reserved_gib')}}))" \
    | tee -a $OUT/pair_measured.jsonl
  echo "$name done at $(( $(date +%s) - T0 )) s"
done
echo "call took $(( $(date +%s) - T0 )) s"
