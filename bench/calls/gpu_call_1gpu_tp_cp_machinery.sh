# On nvidia-h200 (no machine of two GPUs was lent): the CUDA paths' checks, then the TP and CP code paths
# over a group of one rank beside the plain run (bench/tp_cp_machinery_1gpu.py), after and before the change.
# Run from a copy of the repository holding src/ (after), before/src + before/bench (the branch point's src with this
# tree's bench scripts), tests/ and .whl/ (pydantic and its three dependencies for Python 3.12):
#   cd .wt18 && bash bench/calls/gpu_call_1gpu_tp_cp_machinery.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version)"
PYTHONPATH=/tmp/ors:$PWD/src timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_paths.py 2>&1 \
  | tail -6 | tee $OUT/gpu_tests.log
PYTHONPATH=/tmp/ors timeout 240 python3 bench/tp_cp_machinery_1gpu.py --out $OUT/tp_cp_machinery-1gpu-after.json \
  --variants plain,tp_machinery,cp_machinery 2>&1 | grep "RESULT\|Error" | tail -20
PYTHONPATH=/tmp/ors timeout 170 python3 before/bench/tp_cp_machinery_1gpu.py \
  --out $OUT/tp_cp_machinery-1gpu-before.json --variants tp_machinery,cp_machinery 2>&1 | grep "RESULT\|Error" | tail -20
