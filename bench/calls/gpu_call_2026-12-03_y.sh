# One H200, call y: the step whose gradient norm, clip factor and non-finite skip stay on the GPU (the optimizer is
# queued behind the backward). The GPU tests of the fused Adam (the skip over the three update paths) and of the CUDA
# paths; LoRA and full fine-tuning at the peers' workload without recompute, interleaved, two runs each, with the
# profiled step's timeline (bench/step_gaps.py); then LoRA of all 48 layers compiled, with Dynamo's recompile log.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-03_y.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, sys; print(torch.__version__, torch.version.cuda, transformers.__version__, sys.version.split()[0])"
timeout 150 python3 -m pytest tests/gpu/test_fused_adam.py tests/gpu/test_pinned_state.py tests/gpu/test_cuda_paths.py \
  -q -p no:cacheprovider -W ignore 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
run() {  # name, variants, seconds
  left=$(( 570 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "skip $1"; return; }
  TORCH_LOGS=recompiles timeout $(( left < $3 ? left : $3 )) python3 bench/engine_speed.py --out $OUT/$1.json \
    --variants $2 --timeline > /tmp/$1.log 2>&1
  grep -E "RESULT|Error" /tmp/$1.log | cut -c1-250; echo "recompiles: $(grep -c 'Recompiling function' /tmp/$1.log)"
  echo "$1 done at $(( $(date +%s) - T0 )) s"
}
run lora single_bal_c_none_lora,single_bal_c_none,single_bal_c_none_lora,single_bal_c_none 230
python3 - <<'PY'
import json, os
path = os.path.join(os.environ["OUT"], "lora.json")
for r in json.load(open(path))["results"] if os.path.exists(path) else []:
    g = r.get("gaps", {})
    print(r["variant"], r.get("measure", {}).get("tokens_per_s_per_gpu"), {k: v for k, v in g.items() if k != "longest_gaps"})
    for gap in g.get("longest_gaps", [])[:6]:
        print("   ", round(gap["at_ms"], 2), round(gap["ms"], 3), gap["host"][:3])
PY
run lora48 lora48_bal_c 170
echo "call took $(( $(date +%s) - T0 )) s"
