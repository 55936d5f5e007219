# One H200, call g (2026-12-04): call o's 16-layer tuner start (bench/tune_h200_16l_start.yaml: optimizer offload 0.5,
# full recompute, one row per microbatch, two rows per step) on this tree, within 8.5 minutes that include
# verification, remeasurement and the card; rows built from inputs under runs/ as in call o. Everything it wrote but
# the trial run directories comes back as tune16.tgz.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-04_g.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 bench/h200_rows.py runs/h200-inputs 250 > /dev/null
timeout 60 python3 -m openrecipes data build runs/h200-inputs/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out tune-rows 2>&1 | tail -1
start=$(date +%s)
timeout 545 python3 -m openrecipes tune bench/tune_h200_16l_start.yaml --gpus 1xH200 --minutes 8.5 --trials 12 \
  --trial-steps 12 --remeasure 2 --out runs/tune16 > /tmp/tune16.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" | tee $OUT/tune_wall.json
cp /tmp/tune16.log runs/tune16/tune.log
tar -czf $OUT/tune16.tgz --exclude='run' --exclude='*.safetensors' --exclude='rows' -C runs tune16 2>/dev/null
tail -30 /tmp/tune16.log | cut -c1-250
echo "call took $(( $(date +%s) - T0 )) s"
