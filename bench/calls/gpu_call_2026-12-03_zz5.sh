# One H200, call zz5: the tuner from LoRA of all 48 layers within 5 minutes as calls zz2 and zz4 ran it, now with the
# trial zygote importing Dynamo and the engine's parallelize step before it forks (tune/zygote.py preload_dynamo).
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-03_zz5.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 bench/h200_rows.py /tmp/in8 250
timeout 60 python3 -m openrecipes data build /tmp/in8/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out tune-rows 2>&1 | tail -1
start=$(date +%s)
TORCH_LOGS=recompiles timeout $(( ${MINUTES:-5} * 60 + 40 )) python3 -m openrecipes tune bench/tune_h200_lora48_start.yaml \
  --gpus 1xH200 --minutes ${MINUTES:-5} --trials 8 --trial-steps 12 --remeasure 1 --out /tmp/tune > /tmp/tune.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" | tee $OUT/tune_wall.json
tail -30 /tmp/tune.log | cut -c1-250
for log in /tmp/tune/trials/*/train.log; do echo "$(basename $(dirname $log)) $(grep -c 'Recompiling function' $log)"; done \
  > /tmp/tune/recompiles.txt 2>/dev/null
cp /tmp/tune.log /tmp/tune/tune.log
tar -czf $OUT/tune.tgz --exclude='run' --exclude='*.safetensors' --exclude='rows' -C /tmp tune 2>/dev/null
cat /tmp/tune/recompiles.txt; echo "call took $(( $(date +%s) - T0 )) s"
