# DP2-EP2 with half of the optimizer on the CPU, after the CPU update moved to cache-sized slices
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/typing_extensions*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=16
timeout 300 python3 bench/engine_speed.py --out $OUT/engine_speed-2gpu-offload-sliced.json --variants dp2ep2_pa_off_bal --steps 10 2>&1 | grep RESULT
