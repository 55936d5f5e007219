# On nvidia-h200-x2: TP2 (SP) and CP2 before and after the host-overhead work, beside DP2, in one call.
# Run from a copy of the repository holding src/ (after), before/src + before/bench (the branch point's src with this
# engine_speed.py), tests/ and .whl/ (pydantic and its three dependencies for Python 3.12):
#   cd .wt18 && bash bench/calls/gpu_call_2gpu_tp_cp.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version)"
# the CUDA paths against their references first: context parallelism's varlen query slices, with gradients
PYTHONPATH=/tmp/ors:$PWD/src timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_paths.py 2>&1 \
  | tail -4 | tee $OUT/gpu_tests.log
# after: this tree (the profiled step, 19, is outside the window 5-18)
PYTHONPATH=/tmp/ors:$PWD/src timeout 330 python3 bench/engine_speed.py --out $OUT/engine_speed-2gpu-after.json \
  --variants tp2_pa_bal,cp2_pa_bal,dp2_pa_bal 2>&1 | grep "RESULT\|Error\|error:" | tail -20
# before: the branch point's code, same settings
PYTHONPATH=/tmp/ors:$PWD/before/src timeout 200 python3 before/bench/engine_speed.py \
  --out $OUT/engine_speed-2gpu-before.json --variants tp2_pa_bal,cp2_pa_bal 2>&1 | grep "RESULT\|Error\|error:" | tail -20
