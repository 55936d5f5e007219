# One H200, 2026-12-01, call f: the two CUDA tests that failed in call e, with their whole report (the chunked-loss
# test now judges both bf16 paths against fp32); then the reduced-depth Qwen3-30B-A3B (8 layers) through SFT, LoRA
# and long-context SFT (32,768-token rows), each written as an item of verification/qwen3-30b-a3b-8l.yaml by
# `card verify-item` (issues: one-GPU speed, workflows, verification cards).
# Rows: bench/h200_rows.py + `openrecipes data build` (Qwen3's tokenizer files), carried as h200-rows/.
# Run from the repository root with .whl and h200-rows carried:  bash bench/calls/gpu_call_2026-12-01_f.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated*.whl .whl/typing_insp*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf --tb=short \
  "tests/gpu/test_compile_gpu.py::test_compiled_blocks_round_no_worse_than_eager[selective-True]" \
  tests/gpu/test_memory_knobs_gpu.py::test_chunked_loss_peak_is_a_fraction_of_the_logits_path 2>&1 \
  | grep -v DEBUG | tail -40 > $OUT/gpu_tests_f.log
cat $OUT/gpu_tests_f.log | tail -8
mkdir -p /tmp/ver
NOTE="Reduced-depth Qwen3-30B-A3B: the model's real widths (hidden 2048, 128 experts top-8, vocabulary 151,936) and 8 of its 48 layers, random init (seed 0); one H200."
for item in sft:sft lora:lora long-context:long-context-sft; do
  name=${item%%:*}; workflow=${item##*:}
  timeout 230 python3 -m openrecipes train bench/h200_items/qwen3-30b-a3b-8l-$name.yaml 2>&1 | tail -4
  run=$(python3 -c "from openrecipes.config.recipe import load_recipe; print(load_recipe('bench/h200_items/qwen3-30b-a3b-8l-$name.yaml').run_dir)")
  status=unverified; [ "$name" = lora ] && status=verified
  python3 -m openrecipes card verify-item $run --model qwen3-30b-a3b-8l --workflow $workflow --cards /tmp/ver \
    --status $status --model-name "Qwen3-30B-A3B (8 layers)" --description "$NOTE" \
    --checkpoint-source "random init (seed 0) of the registry's qwen3-30b-a3b config at 8 layers" \
    --command "openrecipes train bench/h200_items/qwen3-30b-a3b-8l-$name.yaml" 2>&1 | tail -3
  python3 -m openrecipes measure $run --json > $OUT/measure-$name.json 2>&1 || python3 -m openrecipes measure $run > $OUT/measure-$name.json 2>&1
  tail -2 $run/metrics.jsonl | cut -c1-300
done
cp /tmp/ver/qwen3-30b-a3b-8l.yaml $OUT/
ls $OUT
