# One H200, call n: long rows past 32K (64K and 128K single-document rows, 8 layers, compiled, full recompute, loss in
# chunks of 8,192), the 32K row without recompute and without the chunked loss, LoRA at 8 layers (profiled) and of all
# 48 layers compiled with torch's recompile log (the first layer's input now requires grad), then transformers at 64K.
# Run from the repository root with .whl and .peers carried:  bash bench/calls/gpu_call_2026-12-02_n.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 290 python3 bench/engine_speed.py --out $OUT/engine_long.json \
  --variants long64k_c,long128k_c,long32k_c_none_nochunk > /tmp/engine_long.log 2>&1
grep -E "RESULT|Error" /tmp/engine_long.log | cut -c1-300 | uniq | tee $OUT/engine_long_log.txt
echo "engine long done at $(( $(date +%s) - T0 )) s"
TORCH_LOGS=recompiles timeout 200 python3 bench/engine_speed.py --out $OUT/engine_lora.json \
  --variants single_bal_c_lora,lora48_bal_c > /tmp/lora.log 2>&1
grep -E "RESULT|Recompil|recompile|cache_size_limit|Error" /tmp/lora.log | cut -c1-300 | sort | uniq -c | head -20 | tee $OUT/engine_lora_log.txt
echo "lora done at $(( $(date +%s) - T0 )) s"
timeout $(( 585 - ($(date +%s) - T0) )) python3 .peers/hf_bench.py --balanced --seq 65536 --steps 8 --out $OUT/hf_64k.jsonl > /tmp/hf.log 2>&1
tail -3 /tmp/hf.log | cut -c1-400
echo "call took $(( $(date +%s) - T0 )) s"
