# One H200, 2026-12-01, call g: the compiled-block CUDA tests (the selective case called the recompute helper wrongly
# in call f), then the tuner's 16-layer memory-bound start with the three one-field changes that make up the winner of
# call d (offload off; two rows per microbatch; recompute of the first 8 layers only), each measured as a --try trial
# in the same harness as call d (12 steps, same rows) (issues: tuner, one-GPU speed).
# Run from the repository root with .whl and h200-rows carried:  bash bench/calls/gpu_call_2026-12-01_g.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated*.whl .whl/typing_insp*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf --tb=short tests/gpu/test_compile_gpu.py 2>&1 \
  | grep -v DEBUG | tail -25 > $OUT/gpu_tests_g.log
tail -5 $OUT/gpu_tests_g.log
cp -r h200-rows/tune-rows tune-rows
timeout 420 python3 -m openrecipes tune bench/tune_h200_16l_start.yaml --gpus 1xH200 --minutes 5 --trials 4 \
  --trial-steps 12 --trial-timeout 120 --out /tmp/tune \
  --try "offload.fraction=0.0" --try "layout.max_tokens_per_gpu=16384 layout.rows_per_microbatch=2" \
  --try "recompute.method=block recompute.num_layers=8" 2>&1 | tail -16
cp /tmp/tune/trials.jsonl $OUT/tune16_onefield_trials.jsonl; cp /tmp/tune/pruned.jsonl $OUT/tune16_onefield_pruned.jsonl
ls $OUT
