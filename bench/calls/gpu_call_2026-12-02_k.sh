# One H200, call k: LoRA (rank 16, q/k/v/o and every routed expert, frozen bf16 base) beside full fine-tuning at the
# same shape and transformers + peft in this call, all 48 layers under LoRA compiled with torch's recompile log, then
# the memory knobs that need more than one row per microbatch (the first memory-knob call refused them: max_tokens_per_gpu).
# Run from the repository root with .whl and .peers carried:  bash bench/calls/gpu_call_2026-12-02_k.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, peft, sys; print(torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__, sys.version.split()[0])"
TORCH_LOGS=recompiles timeout 330 python3 bench/engine_speed.py --out $OUT/engine_lora.json \
  --variants single_bal_c,single_bal_c_lora,lora48_bal_c > /tmp/engine_lora.log 2>&1
grep -E "RESULT|Recompil|recompile|cache_size_limit|Error" /tmp/engine_lora.log | cut -c1-300 | sort | uniq -c | head -40 | tee $OUT/engine_lora_log.txt
timeout 120 python3 .peers/hf_peft_bench.py --balanced --out $OUT/peft.jsonl > /tmp/peft.log 2>&1; tail -3 /tmp/peft.log
[ -f tune-rows/manifest.json ] || source bench/tune18_rows.sh
source bench/memory_knob_runs.sh $OUT/memory_knobs2_measured.jsonl 520 90 <<'VARIANTS'
full-r2 --set layout.rows_per_microbatch=2 --set layout.max_tokens_per_gpu=16384
none-r2 --set recompute.granularity=none --set layout.rows_per_microbatch=2 --set layout.max_tokens_per_gpu=16384
full-r4 --set layout.rows_per_microbatch=4 --set layout.max_tokens_per_gpu=32768
compile-none-r2 --set kernels.compile=true --set recompute.granularity=none --set layout.rows_per_microbatch=2 --set layout.max_tokens_per_gpu=16384
compile-full-r4 --set kernels.compile=true --set layout.rows_per_microbatch=4 --set layout.max_tokens_per_gpu=32768
chunk2048-none-r2 --set kernels.loss_chunk_tokens=2048 --set recompute.granularity=none --set layout.rows_per_microbatch=2 --set layout.max_tokens_per_gpu=16384
VARIANTS
python3 bench/tune18_predicted.py runs/mem-* > $OUT/memory_knobs2_predicted.jsonl
cat $OUT/memory_knobs2_measured.jsonl
echo "call took $(( $(date +%s) - T0 )) s"
