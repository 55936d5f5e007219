# One H200, 2026-12-01, call j: the image-text examples on CUDA (Qwen3-VL-MoE, and Muse Spark when its example
# exists: bf16, grouped experts, varlen attention over packed image rows), then the SFT and long-context runs of
# call f again with their last step saved, so their items carry the save's hash and can be verified (issues: images,
# verification cards). Each save (about 45 GB with optimizer state) is removed once its item is written.
# As it ran: both image-text examples trained on the H200 (their last metrics lines in bench/logs/2026-12-01-j-*);
# the call's 330 s limit ended it during the first saved run, so no item was written and the items stay unverified.
# Run from the repository root with .whl and h200-rows carried:  bash bench/calls/gpu_call_2026-12-01_j.sh
set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated*.whl .whl/typing_insp*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
for example in examples/tiny-qwen3-vl-moe-sft.yaml examples/tiny-muse-spark-image-sft.yaml; do
  [ -f $example ] || continue
  name=$(basename $example .yaml)
  timeout 90 python3 -m openrecipes train $example --set precision=bf16 --set run_dir=runs/$name-cuda \
    --set logging.progress=false 2>&1 | tail -3
  tail -1 runs/$name-cuda/metrics.jsonl | cut -c1-200 | tee $OUT/$name-cuda.txt
done
mkdir -p /tmp/ver && cp verification/qwen3-30b-a3b-8l.yaml /tmp/ver/
for item in sft:sft long-context:long-context-sft; do
  name=${item%%:*}; workflow=${item##*:}
  timeout 200 python3 -m openrecipes train bench/h200_items/qwen3-30b-a3b-8l-$name.yaml \
    --set checkpoint.at_end=true 2>&1 | tail -2
  run=$(python3 -c "from openrecipes.config.recipe import load_recipe; print(load_recipe('bench/h200_items/qwen3-30b-a3b-8l-$name.yaml').run_dir)")
  du -sh $run/checkpoints
  timeout 150 python3 -m openrecipes card verify-item $run --model qwen3-30b-a3b-8l --workflow $workflow \
    --cards /tmp/ver --status verified \
    --checkpoint-source "the run's last save (weights and optimizer state, step 19 / 13), from a random init (seed 0) of the registry's qwen3-30b-a3b config at 8 layers" \
    --command "openrecipes train bench/h200_items/qwen3-30b-a3b-8l-$name.yaml --set checkpoint.at_end=true" 2>&1 | tail -3
  rm -rf $run/checkpoints
done
cp /tmp/ver/qwen3-30b-a3b-8l.yaml $OUT/
ls $OUT
