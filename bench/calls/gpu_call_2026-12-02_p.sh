# One H200, call p: full recompute that keeps the attention kernel (recompute.granularity full_keep_attention) at
# 32K single-document rows (8 layers, forced balance, compiled), beside full recompute and transformers (sdpa, grad
# checkpointing), interleaved: two rounds of (engine: full, keep, keep with the fused loss; transformers); then full
# recompute with the fused loss once. First the GPU test of compiled blocks under the new granularity.
# Run from the repository root with .whl and .peers carried:  bash bench/calls/gpu_call_2026-12-02_p.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, sys; print(torch.__version__, torch.version.cuda, transformers.__version__, sys.version.split()[0])"
timeout 150 python3 -m pytest tests/gpu/test_compile_gpu.py -q -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/gpu_test.txt
echo "gpu test done at $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  timeout 170 python3 bench/engine_speed.py --out $OUT/engine_32k_r$round.json \
    --variants long32k_c,long32k_c_keep,long32k_c_keep_nochunk > /tmp/engine_r$round.log 2>&1
  grep -E "RESULT|Error" /tmp/engine_r$round.log | cut -c1-300 | tee $OUT/engine_32k_r${round}_log.txt
  echo "engine round $round done at $(( $(date +%s) - T0 )) s"
  timeout 100 python3 .peers/hf_bench.py --balanced --seq 32768 --steps 12 --out $OUT/hf_32k_r$round.jsonl \
    > /tmp/hf_r$round.log 2>&1; tail -2 /tmp/hf_r$round.log | cut -c1-300
  echo "hf round $round done at $(( $(date +%s) - T0 )) s"
done
left=$(( 585 - ($(date +%s) - T0) ))
[ $left -gt 60 ] && timeout $left python3 bench/engine_speed.py --out $OUT/engine_32k_nochunk.json \
  --variants long32k_c_nochunk > /tmp/engine_nochunk.log 2>&1
grep -E "RESULT|Error" /tmp/engine_nochunk.log | cut -c1-300
echo "call took $(( $(date +%s) - T0 )) s"
