# One H200, call e (2026-12-04): the 22-layer tuner (bench/tune_h200_22l_start.yaml) on this tree within 9 minutes,
# verification, remeasured pairs and card included: the memory margin refined from measured peaks (2-5 %), the solved
# fractions re-solved whenever the refit moves, expandable segments by default (call d: its offload 0 ran at 21,035
# tokens/s, the grid's best). Dynamo's recompile log in each trial's log; everything it wrote but the trial run
# directories comes back as tune.tgz.  Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-04_e.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
[ -f tune-rows/manifest.json ] || source bench/tune18_rows.sh
start=$(date +%s)
TORCH_LOGS=recompiles timeout 565 python3 -m openrecipes tune bench/tune_h200_22l_start.yaml --gpus 1xH200 \
  --minutes 9 --trials 12 --trial-steps 12 --remeasure 2 --out /tmp/tune > /tmp/tune.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" | tee $OUT/tune_wall.json
tail -30 /tmp/tune.log | cut -c1-250
for log in /tmp/tune/trials/*/train.log; do echo "$(basename $(dirname $log)) $(grep -c 'Recompiling function' $log)"; done \
  > /tmp/tune/recompiles.txt 2>/dev/null
grep -h -A3 "Recompiling function" /tmp/tune/trials/*/train.log 2>/dev/null | grep -E "    - " | sort | uniq -c \
  | sort -rn | head -20 | cut -c1-300 >> /tmp/tune/recompiles.txt
cp /tmp/tune.log /tmp/tune/tune.log
tar -czf $OUT/tune.tgz --exclude='run' --exclude='*.safetensors' --exclude='rows' -C /tmp tune 2>/dev/null
for s in /tmp/tune/trials/*/run/startup.json; do echo "$(basename $(dirname $(dirname $s))) $(tr -d " \n" < $s)"; done
ls -la $OUT; cat /tmp/tune/recompiles.txt | head -30
echo "call took $(( $(date +%s) - T0 )) s"
