# One H200, 2026-12-01, call h: compiled blocks on packed rows (many documents a row; slower than eager in a tuner
# trial) with torch's recompilation log, beside eager packed rows, and natural routing without recompute (compiled),
# so every single-GPU compiled variant has its natural-routing figure (issue: one-GPU speed).
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-01_h.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated*.whl .whl/typing_insp*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
timeout 150 python3 bench/engine_speed.py --out $OUT/engine_speed_nat.json --variants single_nat_c_none,packed_bal \
  2>&1 | grep "RESULT" | sort -u
TORCH_LOGS=recompiles timeout 150 python3 bench/engine_speed.py --out $OUT/engine_speed_packed_c.json \
  --variants packed_bal_c > /tmp/packed_c.log 2>&1
grep RESULT /tmp/packed_c.log | sort -u
grep -c "Recompiling" /tmp/packed_c.log
grep -A4 "Recompiling" /tmp/packed_c.log | head -60 > $OUT/packed_c_recompiles.log
ls $OUT
