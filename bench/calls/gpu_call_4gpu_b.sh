set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/typing_extensions*.whl
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=16
timeout 330 python3 bench/engine_speed.py --out $OUT/engine_speed-4gpu-seed48.json --variants seed48_dp4ep4_pa_bal --steps 12 2>&1 | grep -v "^step\|it/s\|%|\|Warn\|warn" | tail -15
timeout 230 python3 bench/engine_speed.py --out $OUT/engine_speed-2gpu-offload.json --variants dp2ep2_pa_off_bal --steps 10 2>&1 | grep -v "^step\|it/s\|%|\|Warn\|warn" | tail -15
