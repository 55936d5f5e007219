# the parallel variants again, the profiled step now outside the timing window; training peaks without the build
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/typing_extensions*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0
timeout 420 python3 bench/engine_speed.py --out $OUT/engine_speed-4gpu-final.json --variants dp2_pa_bal,dp2ep2_pa_bal,dp4ep4_pa_bal,dp4ep2_pa_bal,tp2_pa_bal,cp2_pa_bal,tp2dp2ep4_pa_bal 2>&1 | grep RESULT
