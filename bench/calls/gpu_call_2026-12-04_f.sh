# One H200, call f (2026-12-04): the 8-layer search-quality start of call i (bench/tune_h200_start.yaml, the same 24
# pretraining rows, built here) on the tuner of this tree, as call q ran it (6.5 minutes, whole command: search,
# verification, one remeasured pair, ablations and the card). Call i's grid: best 50,058; call q's winner 50,912.
# Everything it wrote but the trial run directories comes back as tune8.tgz.
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
echo "call took $(( $(date +%s) - T0 )) s"
