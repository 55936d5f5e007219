# One H200, 2026-12-01: compiled blocks and offloaded optimizer state streamed through the GPU (issue: one-GPU speed).
# CUDA tests (new: compiled blocks, streamed offload bitwise), the engine's variants, transformers in the same call.
# Run from the repository root with .whl (pydantic wheels) and .peers carried:  bash bench/calls/gpu_call_2026-12-01_speed_a.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version, torch.cuda.get_device_name())"
nproc; free -g | head -2
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu -x 2>&1 | tail -15 | tee $OUT/gpu_tests.log
timeout 330 python3 bench/engine_speed.py --out $OUT/engine_speed.json \
  --variants single_bal,single_bal_c,single_nat_c,single_bal_c_none,single_bal_c_off05,single_bal_off05,accum8_bal_c,accum8_bal_c_off05 2>&1 | grep "RESULT\|Error\|error" | head -40
BUDGET=95 bash .peers/run_all.sh hf_grouped_bal 2>&1 | tail -2; grep RESULT $OUT/*.log | tail -3
ls $OUT
