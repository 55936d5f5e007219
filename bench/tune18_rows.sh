# Rows for the 18-layer tuner benchmark: 48 pretraining rows of 8,192 tokens from 400 synthetic documents
# (bench/h200_rows.py's generator; its first 250 are speed_d's); sourced by
# bench/calls/gpu_call_2026-12-02_tune18_{grid,tune}.sh, needs PYTHONPATH set.
python3 bench/h200_rows.py /tmp/tune18-in 400
timeout 60 python3 -m openrecipes data build /tmp/tune18-in/docs.jsonl --format pretrain --row-tokens 8192 --rows 48 \
  --no-progress --out tune-rows 2>&1 | tail -1
