# One H200, 2026-12-01, second call: compiled loss added to kernels.compile; every variant in its own process.
# CUDA tests, the engine's one-GPU variants (forced and natural routing, recompute modes, offload streamed through the
# GPU or updated by the CPU, 1 and 8 rows per step, Muse Spark at real widths), transformers in the same call.
# Run from the repository root with .whl and .peers carried:  bash bench/calls/gpu_call_2026-12-01_speed_b.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/gpu -p no:logging 2>&1 | grep -v DEBUG | tail -25 > $OUT/gpu_tests.log
tail -5 $OUT/gpu_tests.log
timeout 400 python3 bench/engine_speed.py --out $OUT/engine_speed.json \
  --variants single_bal_c,single_nat_c,single_bal_c_none,single_bal_c_off05,accum8_bal_c,accum8_bal_c_off05,muse4l16e_bal_c,single_bal_hoff05 \
  2>&1 | grep "^RESULT" | head -40
BUDGET=45 bash .peers/run_all.sh hf_grouped_bal 2>&1 | tail -1; grep -h RESULT $OUT/hf.log | cut -c1-300
