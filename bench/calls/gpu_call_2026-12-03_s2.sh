# One H200, call s2: call s again on this tree (bench/trial_launch.py: the 8-layer tuner start, 8 steps, cold and
# warm trials interleaved, two pairs): trials stopped at their last step, the zygote importing Dynamo, the build in bf16.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-03_s2.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 bench/h200_rows.py /tmp/in8 250
timeout 60 python3 -m openrecipes data build /tmp/in8/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out /tmp/rows8 2>&1 | tail -1
timeout 150 python3 bench/trial_launch.py bench/tune_h200_start.yaml /tmp/rows8 /tmp/launch 2 | tee $OUT/trial_launch.jsonl
