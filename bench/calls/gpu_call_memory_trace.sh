# rank 0's memory per phase of the step (engine_speed.py --memory-trace: the recipe's debug.memory_trace) for the
# expert-parallel runs
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/typing_extensions*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0
timeout 400 python3 bench/engine_speed.py --out $OUT/engine_speed-memory-trace.json --variants seed48_dp4ep4_pa_bal,dp4ep4_pa_bal,dp2ep2_pa_bal,dp2_pa_bal --steps 7 --memory-trace 2>&1 | grep RESULT
