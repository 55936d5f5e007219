# One H200, call q: the GPU test of compiled blocks under full_keep_attention (exit status kept this time), then the
# 8-layer search-quality start of call i (bench/tune_h200_start.yaml, the same 24 pretraining rows, built here) on
# the tuner of this tree (trials end early once stable, full_keep_attention in the space) within 6.5 minutes, whole
# command: search, verification, one remeasured pair, ablations and the card. The grid of call i: best 50,058.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-02_q.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest tests/gpu/test_compile_gpu.py -q -p no:cacheprovider -rA -k full_keep_attention \
  > /tmp/gpu_test.txt 2>&1; echo "gpu test exit status $?" | tee $OUT/gpu_test.txt
grep -E "PASSED|FAILED|ERROR" /tmp/gpu_test.txt | tee -a $OUT/gpu_test.txt
echo "gpu test done at $(( $(date +%s) - T0 )) s"
python3 bench/h200_rows.py /tmp/in8 250
timeout 60 python3 -m openrecipes data build /tmp/in8/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out tune-rows 2>&1 | tail -1
echo "rows done at $(( $(date +%s) - T0 )) s"
T1=$(date +%s)
timeout 420 python3 -m openrecipes tune bench/tune_h200_start.yaml --gpus 1xH200 --minutes 6.5 --trials 10 \
  --trial-steps 12 --remeasure 1 --out /tmp/tune8 > /tmp/tune8.log 2>&1
echo "tune exit status $? after $(( $(date +%s) - T1 )) s" | tee $OUT/tune8_status.txt
cp /tmp/tune8.log $OUT/tune8.log; cp /tmp/tune8/trials.jsonl $OUT/tune8_trials.jsonl
find /tmp/tune8/recipes -name "*.yaml" -exec cp {} $OUT/ \; 2>/dev/null
tail -30 /tmp/tune8.log | cut -c1-250
echo "call took $(( $(date +%s) - T0 )) s"
