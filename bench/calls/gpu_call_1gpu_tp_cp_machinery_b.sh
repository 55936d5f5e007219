# Second call on nvidia-h200 (still no machine of two GPUs lent): the plain one-GPU run before and after the MoE's
# bincount (a host sync per layer) went, and rows of 4,096 tokens (about a TP2 or CP2 rank's work on an 8,192-token
# row) plain and through the TP / CP code paths over a group of one rank, after and before.
#   cd .wt18 && bash bench/calls/gpu_call_1gpu_tp_cp_machinery_b.sh   (same copy as gpu_call_1gpu_tp_cp_machinery.sh)
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/ors:$PWD/src timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_paths.py 2>&1 \
  | tail -4 | tee $OUT/gpu_tests_b.log
PYTHONPATH=/tmp/ors timeout 250 python3 bench/tp_cp_machinery_1gpu.py --out $OUT/tp_cp_machinery-1gpu-b-after.json \
  --variants plain,plain_4096,tp_machinery_4096,cp_machinery_4096 2>&1 | grep "RESULT\|Error" | tail -20
PYTHONPATH=/tmp/ors timeout 200 python3 before/bench/tp_cp_machinery_1gpu.py \
  --out $OUT/tp_cp_machinery-1gpu-b-before.json --variants plain,tp_machinery_4096,cp_machinery_4096 2>&1 \
  | grep "RESULT\|Error" | tail -20
