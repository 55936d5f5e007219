# One H200: where a tuner trial's time goes before its steps (train/startup.py's startup.json), for the 18-layer
# start (offload 1.0, bench/tune_h200_18l_start.yaml) and the tuner's compiled candidate; how long allocating the
# offloaded optimizer state takes three ways (bench/pinned_state_alloc.py, 6 of the 18 layers); and where the
# optimizer component test's time goes on the GPU (cProfile).
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-02_trial_overhead.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/versions.txt
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version.split()[0])" >> $OUT/versions.txt
t0=$(date +%s)
timeout 250 python3 -m cProfile -o /tmp/verify.prof -m openrecipes verify optimizer --device cuda --json \
  > $OUT/verify_optimizer.json 2> /tmp/verify.err &
vpid=$!
source bench/tune18_rows.sh
wait $vpid; echo "{\"verify_optimizer_exit\": $?, \"wall_s\": $(( $(date +%s) - t0 ))}" > $OUT/verify_wall.json
tail -3 /tmp/verify.err
python3 -c "import pstats; pstats.Stats('/tmp/verify.prof').sort_stats('cumulative').print_stats(30)" \
  > $OUT/verify_profile.txt 2>&1
t0=$(date +%s); timeout 60 python3 -m openrecipes verify optimizer --device cuda --experts 8 --json \
  > $OUT/verify_optimizer_e8.json 2>&1
echo "{\"experts\": 8, \"wall_s\": $(( $(date +%s) - t0 ))}" >> $OUT/verify_wall.json
for way in per_tensor arena register; do
  timeout 90 python3 bench/pinned_state_alloc.py bench/tune_h200_18l_start.yaml $way 6 >> $OUT/pinned.jsonl 2>&1
done
run() {  # name, then --set overrides
  name=$1; shift; t0=$(date +%s)
  timeout 170 python3 -m openrecipes train bench/tune_h200_18l_start.yaml "$@" --set run_dir=runs/$name \
    > /tmp/$name.log 2>&1
  echo "{\"run\": \"$name\", \"exit\": $?, \"wall_s\": $(( $(date +%s) - t0 ))}" >> $OUT/walls.jsonl
  tail -2 /tmp/$name.log; cp runs/$name/startup.json $OUT/$name-startup.json
  python3 -m openrecipes measure runs/$name --window 5 11 --json > $OUT/$name-measured.json 2>&1
}
run start
run compiled --set kernels.compile=true --set layout.max_tokens_per_gpu=32768 --set layout.rows_per_microbatch=4 \
  --set offload.fraction=0.0 --set recompute.method=block --set recompute.num_layers=16
