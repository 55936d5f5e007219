#!/usr/bin/env bash
# One tuner run per start, each bundled into one results file (bench/tune_bundle.py):
# OUT_DIR=DIR MINUTES=4.2 bench/tune_family.sh START.yaml [START.yaml ...]
# Rows: pretraining rows of the start's row length, built by `openrecipes data build --format pretrain` (the bundled
# tokenizer) from bench/h200_rows.py's documents of random words, in a working directory per start where the tuner
# runs (the starts name their rows `tune-rows`): rows a card can describe, as a user's are.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${OUT_DIR:-bench/tune-out}
minutes=${MINUTES:-4.2}
mkdir -p "$out"
for start in "$@"; do
  name=$(basename "$start" .yaml)
  work=$(mktemp -d)
  python3 bench/h200_rows.py "$work/in" > /dev/null
  row_tokens=$(python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["layout"]["max_tokens_per_gpu"])' "$start")
  python3 -m openrecipes data build "$work/in/docs.jsonl" --format pretrain --row-tokens "$row_tokens" --rows 24 \
    --out "$work/tune-rows" > /dev/null
  args=(--gpus auto --minutes "$minutes" --trials 10 --trial-steps 12 --remeasure 2)
  (cd "$work" && python3 -m openrecipes tune "$repo/$start" "${args[@]}" --out "$work/tune" 2>&1 | tee "$work/tune.log") \
    || echo "tune of $start failed" >&2
  python3 bench/tune_bundle.py "$work/tune" --start "$start" --log "$work/tune.log" --out "$out/tune-$name.json" \
    --command "openrecipes tune $start ${args[*]} --out /tmp/tune (rows: 24 pretraining rows of $row_tokens tokens, bench/tune_family.sh)"
done
