# One H200, call t: (1) the engine on the peers' workload (one 8,192-token document per row) and on packed rows, compiled, this tree
# against the tree before that change (.before/, carried), two interleaved rounds, with Dynamo's recompile log;
# (2) the memory of each phase (debug.memory_trace: each microbatch's forward and backward apart) of the 18-layer
# tuner start (its optimizer and rows, one microbatch a step) at settings the planner misses: compiled 4 rows, eager
# 4 rows with offload 0.2, and at 16 layers 2 rows with block recompute of 10, 3 (compiled) and 11 (eager) layers;
# 8 layers compiled 4 rows; (3) the GPU tests of compiled blocks, with the time left.
# Run from the repository root with .whl and .before carried:  bash bench/calls/gpu_call_2026-12-02_t.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version.split()[0])"
for round in 1 2; do
  for tree in before after; do
    script=bench/engine_speed.py; [ $tree = before ] && script=.before/bench/engine_speed.py
    TORCH_LOGS=recompiles timeout 120 python3 $script --out $OUT/speed_${tree}_r$round.json \
      --steps 14 --variants single_bal_c,packed_bal_c > /tmp/speed_${tree}_r$round.log 2>&1
    grep -E "RESULT|Error" /tmp/speed_${tree}_r$round.log | cut -c1-200
    echo "recompiles $tree r$round: $(grep -c 'Recompiling function' /tmp/speed_${tree}_r$round.log)"
    grep -A3 "Recompiling function" /tmp/speed_${tree}_r$round.log | grep -E "Recompiling|    - " | cut -c1-300 \
      > $OUT/recompiles_${tree}_r$round.txt
  done
  echo "round $round done at $(( $(date +%s) - T0 )) s"
done
source bench/tune18_rows.sh
# layers, rows per microbatch, optimizer offload, compiled, recompute method and layers (block: the first N recompute)
for variant in "18 4 0 true uniform 1" "18 4 0.2 false uniform 1" "16 2 0 true block 10" "16 2 0 true block 3" \
               "16 2 0 false block 11" "8 4 0 true uniform 1"; do
  set -- $variant; name=l$1-r$2-off$3-c$4-$5$6
  timeout 100 python3 -m openrecipes train bench/tune_h200_18l_start.yaml --set model_overrides.num_hidden_layers=$1 \
    --set layout.rows_per_microbatch=$2 --set layout.max_tokens_per_gpu=$(( $2 * 8192 )) --set offload.fraction=$3 \
    --set kernels.compile=$4 --set recompute.method=$5 --set recompute.num_layers=$6 --set debug.memory_trace=true \
    --set global_batch=$2 --set steps=3 --set run_dir=runs/mem-$name > /tmp/mem-$name.log 2>&1
  echo "$name exit $? at $(( $(date +%s) - T0 )) s"; tail -1 /tmp/mem-$name.log | cut -c1-200
  cp runs/mem-$name/metrics.jsonl $OUT/mem-$name.metrics.jsonl 2>/dev/null
done
left=$(( 590 - ($(date +%s) - T0) ))
[ $left -gt 40 ] && timeout $left python3 -m pytest tests/gpu/test_compile_gpu.py -p no:cacheprovider -rA 2>&1 | \
  tail -8 | tee $OUT/gpu_test.txt
echo "call took $(( $(date +%s) - T0 )) s"
