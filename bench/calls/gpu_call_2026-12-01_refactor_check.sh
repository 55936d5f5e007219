# One H200, 2026-12-01: after the architecture refactor (parallelize step, composable recompute, kernels chosen at
# build) and the merged TP/CP, LoRA and tuner work: the CUDA tests, the engine on the peers' workload beside
# transformers in the same call, and a short tuner run. Run from the repository root with .whl (pydantic and its
# dependencies for Python 3.12) and .peers (../shared/peers) carried:  bash bench/calls/gpu_call_2026-12-01_refactor_check.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version, torch.cuda.get_device_name())"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -8 | tee $OUT/gpu_tests.log
timeout 120 python3 bench/engine_speed.py --out $OUT/engine_speed.json --variants single_bal 2>&1 | grep "RESULT\|Error"
BUDGET=100 bash .peers/run_all.sh hf_grouped_bal 2>&1 | tail -3; grep RESULT $OUT/*.log | tail -3
# the tuner: pretraining rows from generated text, then a 2.5-minute search from the hand recipe
python3 - <<'PY'
import json, random
random.seed(0)
words = [''.join(random.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(random.randint(2, 9))) for _ in range(5000)]
with open('/tmp/docs.jsonl', 'w') as f:
    for _ in range(400):
        f.write(json.dumps({'text': ' '.join(random.choice(words) for _ in range(random.randint(300, 2500)))}) + '\n')
PY
timeout 40 python3 -m openrecipes data build /tmp/docs.jsonl --format pretrain --row-tokens 8192 --rows 40 \
  --no-progress --out tune-rows 2>&1 | tail -2
timeout 210 python3 -m openrecipes tune bench/tune_h200_start.yaml --gpus 1xH200 --minutes 2.5 --trials 6 \
  --trial-steps 20 --trial-timeout 100 --out /tmp/tune 2>&1 | tail -25
ls /tmp/tune; cp /tmp/tune/trials.jsonl $OUT/tune_trials.jsonl; cp /tmp/tune/tuned.yaml $OUT/tune_tuned.yaml
find /tmp/tune/recipes -name "*.yaml" -exec cp {} $OUT/tune_card.yaml \;
