# One H200, call x: FlexAttention and where LoRA's step waits. The GPU tests of FlexAttention against the reference
# with gradients and of packed rows never recompiling a compiled block; packed 8K rows compiled with flash varlen
# (auto) and FlexAttention, interleaved, two runs each; LoRA and full fine-tuning at the peers' workload without
# recompute, each with its profiled step's timeline (bench/step_gaps.py: the GPU's idle gaps and what the host ran);
# one 32K document per row without recompute (fused loss) beside transformers in this call.
# Run from the repository root with .whl and .peers carried:  bash bench/calls/gpu_call_2026-12-03_x.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, sys; print(torch.__version__, torch.version.cuda, transformers.__version__, sys.version.split()[0])"
timeout 120 python3 -m pytest tests/gpu/test_cuda_paths.py tests/gpu/test_compile_gpu.py -q -p no:cacheprovider -W ignore \
  -k "flex or varlen or never_recompile" 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
run() {  # name, variants, seconds
  left=$(( 570 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "skip $1"; return; }
  timeout $(( left < $3 ? left : $3 )) python3 bench/engine_speed.py --out $OUT/$1.json --variants $2 --timeline \
    > /tmp/$1.log 2>&1
  grep -E "RESULT|Error" /tmp/$1.log | cut -c1-250; echo "$1 done at $(( $(date +%s) - T0 )) s"
}
run packed packed_bal_c,packed_bal_c_flex,packed_bal_c,packed_bal_c_flex 200
run lora single_bal_c_none_lora,single_bal_c_none 110
python3 - <<'PY'
import json, os
for f in ("lora",):
    path = os.path.join(os.environ["OUT"], f + ".json")
    if os.path.exists(path):
        for r in json.load(open(path))["results"]:
            g = r.get("gaps", {})
            print(r["variant"], {k: v for k, v in g.items() if k != "longest_gaps"})
            for gap in g.get("longest_gaps", [])[:8]:
                print("   ", round(gap["at_ms"], 2), round(gap["ms"], 3), gap["host"][:3])
PY
run long long32k_c_none_nochunk 80
left=$(( 580 - ($(date +%s) - T0) ))
[ $left -gt 50 ] && timeout $left python3 .peers/hf_bench.py --balanced --seq 32768 --steps 12 --out $OUT/hf_32k.jsonl \
  > /tmp/hf.log 2>&1; tail -2 /tmp/hf.log | cut -c1-250
echo "call took $(( $(date +%s) - T0 )) s"
