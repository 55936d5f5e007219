#!/usr/bin/env bash
# The seed layouts measured rank by rank on one GPU (openrecipes measure-rank, docs/plan.md "One rank measured
# alone"): bench/measure_ranks.sh [qwen3-30b-a3b-8xh200] [muse-spark-128xh200] [OUT_DIR]
# Rows: the Qwen3 recipe's data.build needs your conversations and the Qwen3 tokenizer (CONVERSATIONS, TOKENIZER).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-bench/ranks}
mkdir -p "$out"
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(qwen3-30b-a3b-8xh200 muse-spark-128xh200)
for name in "${names[@]}"; do
  case "$name" in
    qwen3-30b-a3b-8xh200)  # seed 004: EP8 DP8, 48 layers on every rank; one rank stands for all
      openrecipes measure-rank examples/qwen3-30b-a3b-8xh200.yaml --gpus 8xH200 --ranks 0 --json \
        --set data.build.input="${CONVERSATIONS:?set CONVERSATIONS}" --set data.build.tokenizer="${TOKENIZER:?}" \
        --out "$out/$name" > "$out/$name.json" ;;
    muse-spark-128xh200)  # seed 000: TP4 PP16 (3, 4 x 14, 3 layers) EP8 DP2, optimizer offload 0.3: the default
      # ranks 0, 8 and 120 are the first, a middle and the last stage, each stage's neighbours assumed (docs/plan.md)
      openrecipes measure-rank examples/tiny-muse-sft.yaml --gpus 128xH200 --json \
        --set model=muse-spark-open-816b-a42b --set data.build.row_tokens=8192 --set data.build.rows=256 \
        --set layout.max_tokens_per_gpu=8192 --set layout.tp=4 --set layout.sequence_parallel=true --set layout.pp=16 \
        --set layout.pp_first_stage_layers=3 --set layout.pp_last_stage_layers=3 \
        --set layout.ep=8 --set layout.dp=2 --set offload.fraction=0.3 --set global_batch=128 \
        --out "$out/$name" > "$out/$name.json" ;;
    *) echo "unknown layout $name (qwen3-30b-a3b-8xh200, muse-spark-128xh200)" >&2; exit 2 ;;
  esac
done
