# One H200, 2026-12-01, third call: the compiled-block CUDA test against an fp32 oracle, Muse Spark at real widths,
# offload 1.0 streamed, then the tuner from the memory-bound 16-layer hand recipe (bench/tune_h200_16l_start.yaml).
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-01_speed_c.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_compile_gpu.py tests/gpu/test_fused_adam.py -p no:logging 2>&1 | grep -v DEBUG | grep -E "passed|failed|Error|assert" | tail -8 > $OUT/gpu_tests.log
cat $OUT/gpu_tests.log
timeout 120 python3 bench/engine_speed.py --out $OUT/engine_speed.json --variants muse4l16e_bal_c,single_bal_c_off10 2>&1 | grep "^RESULT" | sort -u
python3 - <<'PY'
import json, random
random.seed(0)
words = [''.join(random.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(random.randint(2, 9))) for _ in range(5000)]
with open('/tmp/docs.jsonl', 'w') as f:
    for _ in range(250):
        f.write(json.dumps({'text': ' '.join(random.choice(words) for _ in range(random.randint(300, 2500)))}) + '\n')
PY
timeout 40 python3 -m openrecipes data build /tmp/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out tune-rows 2>&1 | tail -1
timeout 330 python3 -m openrecipes tune bench/tune_h200_16l_start.yaml --gpus 1xH200 --minutes 3.8 --trials 9 \
  --trial-steps 12 --trial-timeout 75 --out /tmp/tune 2>&1 | tail -22
cp /tmp/tune/trials.jsonl $OUT/tune16_trials.jsonl; cp /tmp/tune/tuned.yaml $OUT/tune16_tuned.yaml
find /tmp/tune/recipes -name "*.yaml" -exec cp {} $OUT/tune16_card.yaml \;
