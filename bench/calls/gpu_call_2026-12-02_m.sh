# One H200, call m: long rows. The engine at one 32,768-token document per row (8 layers, forced balance, compiled,
# loss in chunks of 8,192) with each attention path and recompute choice, transformers (sdpa, grad checkpointing) at
# the same row in this call, then every attention path alone at 8K-128K tokens (bench/attention_paths.py).
# Run from the repository root with .whl and .peers carried:  bash bench/calls/gpu_call_2026-12-02_m.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, sys; print(torch.__version__, torch.version.cuda, transformers.__version__, sys.version.split()[0])"
timeout 330 python3 bench/engine_speed.py --out $OUT/engine_long32k.json \
  --variants long32k_c,long32k_c_varlen,long32k_c_experts,long32k_c_none > /tmp/engine_long.log 2>&1
grep -E "RESULT|Error" /tmp/engine_long.log | cut -c1-300 | tee $OUT/engine_long32k_log.txt
echo "engine done at $(( $(date +%s) - T0 )) s"
timeout 110 python3 .peers/hf_bench.py --balanced --seq 32768 --steps 12 --out $OUT/hf_32k.jsonl > /tmp/hf.log 2>&1; tail -4 /tmp/hf.log
echo "hf done at $(( $(date +%s) - T0 )) s"
timeout $(( 580 - ($(date +%s) - T0) )) python3 bench/attention_paths.py --out $OUT/attention_paths.json > /tmp/attn.log 2>&1
tail -40 /tmp/attn.log | cut -c1-250
echo "call took $(( $(date +%s) - T0 )) s"
