# One H200, 2026-12-01: the tuner from the memory-bound 16-layer hand recipe (bench/tune_h200_16l_start.yaml), trials
# of 12 steps (window 5-11) to fit one call. Run from the repository root with .whl carried:
#   bash bench/calls/gpu_call_2026-12-01_tune16.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
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
timeout 500 python3 -m openrecipes tune bench/tune_h200_16l_start.yaml --gpus 1xH200 --minutes 6 --trials 10 \
  --trial-steps 12 --trial-timeout 240 --out /tmp/tune 2>&1 | tail -30
cp /tmp/tune/trials.jsonl $OUT/tune16_trials.jsonl; cp /tmp/tune/pruned.jsonl $OUT/tune16_pruned.jsonl
cp /tmp/tune/tuned.yaml $OUT/tune16_tuned.yaml; find /tmp/tune/recipes -name "*.yaml" -exec cp {} $OUT/tune16_card.yaml \;
