# Rows for the 18-layer tuner benchmark: 48 pretraining rows of 8,192 tokens from synthetic documents (sourced by
# bench/gpu_call_2026-12-02_tune18_{grid,tune}.sh; needs PYTHONPATH set).
python3 - <<'PY'
import json, random
random.seed(0)
words = [''.join(random.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(random.randint(2, 9))) for _ in range(5000)]
with open('/tmp/docs.jsonl', 'w') as f:
    for _ in range(400):
        f.write(json.dumps({'text': ' '.join(random.choice(words) for _ in range(random.randint(300, 2500)))}) + '\n')
PY
timeout 60 python3 -m openrecipes data build /tmp/docs.jsonl --format pretrain --row-tokens 8192 --rows 48 \
  --no-progress --out tune-rows 2>&1 | tail -1
