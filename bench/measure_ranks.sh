#!/usr/bin/env bash
# The seed layouts measured rank by rank on one GPU (openrecipes measure-rank, docs/plan.md "One rank measured
# alone"): OUT_DIR=DIR bench/measure_ranks.sh [qwen3-30b-a3b-8xh200] [qwen3-30b-a3b-8xh100-top]
# [qwen3-30b-a3b-8xh200-top] [muse-spark-128xh200]
# Rows: random token rows at the recipe's row length unless CONVERSATIONS and TOKENIZER are set (the Qwen3 recipe's
# data.build then reads your conversations with the real tokenizer); a rank's memory and compute depend on the rows'
# shapes only, and routing is balanced either way.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-bench/ranks}
mkdir -p "$out"

random_rows() {  # DIR MODEL ROWS ROW_TOKENS: bench/engine_speed.py's random rows in the model's vocabulary
  python3 - "$@" <<'PY'
import sys
from pathlib import Path
sys.path[:0] = ["bench", "src"]
from engine_speed import write_rows
from openrecipes.models.resolve import resolve_model_config
out, model, rows, row_tokens = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
write_rows(out, rows=rows, row_tokens=row_tokens, vocab=resolve_model_config(model).vocab_size, packed=False)
PY
}

rows_for() {  # NAME MODEL ROWS ROW_TOKENS: the --set arguments that give the recipe its rows
  if [ -n "${CONVERSATIONS:-}" ]; then
    echo "--set data.build.input=$CONVERSATIONS --set data.build.tokenizer=${TOKENIZER:?set TOKENIZER too}"
  else
    random_rows "$out/rows-$1" "$2" "$3" "$4" >&2
    echo "--set data.build=null --set data.rows=$out/rows-$1"
  fi
}
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(qwen3-30b-a3b-8xh200 muse-spark-128xh200)
for name in "${names[@]}"; do
  case "$name" in
    qwen3-30b-a3b-8xh200)  # seed 004: EP8 DP8, 48 layers on every rank; one rank stands for all
      # (global batch 16: one microbatch of two rows per rank; more only repeats it)
      # shellcheck disable=SC2046
      python3 -m openrecipes measure-rank examples/qwen3-30b-a3b-8xh200.yaml --gpus 8xH200 --ranks 0 --json \
        --set global_batch=16 $(rows_for "$name" qwen3-30b-a3b 64 8192) --out "$out/$name" > "$out/$name.json" ;;
    qwen3-30b-a3b-8xh100-top)  # what `openrecipes plan qwen3-30b-a3b --gpus 8xH100` ranks first (DP8, no recompute,
      # 4,096 tokens per GPU, half the optimizer offloaded; predicted 77.6 of 79.6 GiB)
      # shellcheck disable=SC2046
      python3 -m openrecipes measure-rank examples/qwen3-30b-a3b-8xh200.yaml --gpus 8xH100 --ranks 0 --json \
        --set layout.ep=1 --set layout.max_tokens_per_gpu=4096 --set layout.rows_per_microbatch=1 \
        --set recompute.granularity=none --set offload.fraction=0.5 --set global_batch=8 \
        $(rows_for "$name" qwen3-30b-a3b 32 4096) --out "$out/$name" > "$out/$name.json" ;;
    qwen3-30b-a3b-8xh200-top)  # what `openrecipes plan qwen3-30b-a3b --gpus 8xH200` ranks first (DP8, no
      # recompute, 4,096 tokens per GPU, the optimizer on the device; predicted 89.4 GiB: an H200's)
      # shellcheck disable=SC2046
      python3 -m openrecipes measure-rank examples/qwen3-30b-a3b-8xh200.yaml --gpus 8xH200 --ranks 0 --json \
        --set layout.ep=1 --set layout.max_tokens_per_gpu=4096 --set layout.rows_per_microbatch=1 \
        --set recompute.granularity=none --set offload.fraction=0.0 --set global_batch=8 \
        $(rows_for "$name" qwen3-30b-a3b 32 4096) --out "$out/$name" > "$out/$name.json" ;;
    muse-spark-128xh200)  # seed 000: TP4 PP16 (3, 4 x 14, 3 layers) EP8 DP2, optimizer offload 0.3: the default
      # ranks 0, 8 and 120 are the first, a middle and the last stage, each stage's neighbours assumed (docs/plan.md);
      # MUSE_RANKS=0,120 measures those alone
      # shellcheck disable=SC2046
      python3 -m openrecipes measure-rank examples/tiny-muse-sft.yaml --gpus 128xH200 --json ${MUSE_RANKS:+--ranks "$MUSE_RANKS"} \
        --set model=muse-spark-open-816b-a42b $(rows_for "$name" muse-spark-open-816b-a42b 384 8192) \
        --set layout.max_tokens_per_gpu=8192 --set layout.tp=4 --set layout.sequence_parallel=true --set layout.pp=16 \
        --set layout.pp_first_stage_layers=3 --set layout.pp_last_stage_layers=3 \
        --set layout.ep=8 --set layout.dp=2 --set offload.fraction=0.3 --set global_batch=128 \
        --out "$out/$name" > "$out/$name.json" ;;
    *) echo "unknown layout $name (qwen3-30b-a3b-8xh200, qwen3-30b-a3b-8xh100-top, qwen3-30b-a3b-8xh200-top," \
            "muse-spark-128xh200)" >&2
       exit 2 ;;
  esac
done
