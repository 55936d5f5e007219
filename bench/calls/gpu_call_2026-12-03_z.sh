# One H200, call z: LoRA of all 48 layers of Qwen3-30B-A3B compiled, under each recompute choice that may fit
# (none, experts, selective, full keeping attention; call y measured full at 11,264 tokens/s/GPU, 67.9 GiB), each in
# its own process so an out-of-memory ends only that variant, with Dynamo's recompile log; and full recompute with
# two rows in one microbatch (16,384 tokens a step).
# Then LoRA at 8 layers without recompute beside transformers + peft without gradient checkpointing, same call.
# Run from the repository root with .whl and .peers carried:  bash bench/calls/gpu_call_2026-12-03_z.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
for v in lora48_bal_c_none lora48_bal_c_experts lora48_bal_c_keep lora48_bal_c_2rows lora48_bal_c_sel; do
  left=$(( 400 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "skip $v"; continue; }
  TORCH_LOGS=recompiles timeout $(( left < 120 ? left : 120 )) python3 bench/engine_speed.py --out $OUT/$v.json \
    --variants $v > /tmp/$v.log 2>&1
  echo "$v exit $?: $(grep -E 'RESULT' /tmp/$v.log | head -1 | cut -c1-200)"
  grep -m1 -E "OutOfMemory|Error" /tmp/$v.log | cut -c1-200
  echo "recompiles: $(grep -c 'Recompiling function' /tmp/$v.log); done at $(( $(date +%s) - T0 )) s"
done
timeout 90 python3 bench/engine_speed.py --out $OUT/lora8_none.json --variants single_bal_c_none_lora \
  > /tmp/lora8.log 2>&1; echo "engine lora8 none: $(grep -m1 RESULT /tmp/lora8.log | cut -c1-200)"
timeout 100 python3 .peers/hf_peft_bench.py --balanced --no-recompute --out $OUT/peft_none.jsonl > /tmp/peft.log 2>&1
echo "peft none exit $?"; tail -2 /tmp/peft.log | cut -c1-300
echo "call took $(( $(date +%s) - T0 )) s"
