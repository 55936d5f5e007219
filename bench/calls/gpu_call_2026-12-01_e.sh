# One H200, 2026-12-01, call e: the CUDA tests (compiled blocks with balanced routing, chunked loss, activation
# offload: never run on a GPU before), then the engine compiled with full recompute and without recompute beside
# transformers and torchtitan in both modes, in this one call (issue: one-GPU speed).
# Run from the repository root with .whl (pydantic and torchtitan wheels) and .peers carried.
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated*.whl .whl/typing_insp*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, sys; print(torch.__version__, torch.version.cuda, transformers.__version__, sys.version, torch.cuda.get_device_name())"
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/gpu -rfs 2>&1 | grep -v DEBUG | tail -30 > $OUT/gpu_tests.log
cat $OUT/gpu_tests.log
timeout 210 python3 bench/engine_speed.py --out $OUT/engine_speed.json \
  --variants single_bal_c,single_bal_c_none,single_bal_c_sel 2>&1 | grep "RESULT\|Error" | sort -u | head -20
BUDGET=220 bash .peers/run_all.sh hf_grouped_bal tt_eager_bal hf_grouped_bal_norc tt_eager_bal_norc 2>&1 | tail -3
grep -h RESULT $OUT/*.log | tail -8
ls $OUT
