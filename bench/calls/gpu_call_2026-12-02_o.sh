# One H200, call o: the tuner again from the 16-layer memory-bound start (bench/tune_h200_16l_start.yaml: optimizer
# offload 0.5, full recompute, one row per microbatch, two rows per step), within 8.8 minutes that include
# verification, remeasurement and the card. Its rows are built from inputs under runs/ (relative paths), so the card
# it writes names no machine path. Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-02_o.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 bench/h200_rows.py runs/h200-inputs 250 > /dev/null
timeout 60 python3 -m openrecipes data build runs/h200-inputs/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out tune-rows 2>&1 | tail -1
start=$(date +%s)
timeout 560 python3 -m openrecipes tune bench/tune_h200_16l_start.yaml --gpus 1xH200 --minutes 8.8 --trials 12 \
  --trial-steps 12 --remeasure 2 --out runs/tune16 > $OUT/tune16.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" | tee $OUT/tune16_wall.json
tail -40 $OUT/tune16.log
tar czf $OUT/tune16.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='checkpoints' runs/tune16 2>/dev/null
