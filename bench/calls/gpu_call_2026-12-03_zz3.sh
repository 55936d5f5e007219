# One H200, call zz3: cheaper trials. First the two probes of this change: the trial zygote's compiler preload
# (bench/compile_preload.py: no CUDA driver loaded before the fork, the forked child compiles on the GPU) and the
# model build with bf16 weights allocated on the meta device against fp32 then cast (bench/build_time.py, 48 layers);
# then the tuner from LoRA of all 48 layers (bench/tune_h200_lora48_start.yaml) within 5 minutes, as call zz2 ran it,
# on this tree: trials end once their last step is recorded, the zygote preloads the compiler, the build allocates
# bf16 once, and the verification reserve leaves out the winner's first compile. If the preload probe's child fails,
# the tuner runs its trials as new processes (--cold-trials) so the call still measures the rest.
# The probe it ran was the first version of bench/compile_preload.py (with and without the whole compiler preloaded,
# a forked child's error not reported), and the preload it tried was taken out after this call: its child failed.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-03_zz3.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 bench/h200_rows.py /tmp/in8 250
timeout 60 python3 -m openrecipes data build /tmp/in8/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out tune-rows 2>&1 | tail -1
echo "rows done at $(( $(date +%s) - T0 )) s"
timeout 100 python3 bench/compile_preload.py 2 | tee $OUT/compile_preload.jsonl
echo "preload probe done at $(( $(date +%s) - T0 )) s"
timeout 120 python3 bench/build_time.py 48 2 | tee $OUT/build_time.jsonl
echo "build probe done at $(( $(date +%s) - T0 )) s"
cold=""
grep -q '"preload": true.*"correct": true' $OUT/compile_preload.jsonl || cold="--cold-trials"
start=$(date +%s)
TORCH_LOGS=recompiles timeout $(( ${MINUTES:-5} * 60 + 40 )) python3 -m openrecipes tune bench/tune_h200_lora48_start.yaml \
  --gpus 1xH200 --minutes ${MINUTES:-5} --trials 8 --trial-steps 12 --remeasure 1 $cold --out /tmp/tune > /tmp/tune.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start )), \"cold_trials\": \"$cold\"}" | tee $OUT/tune_wall.json
tail -30 /tmp/tune.log | cut -c1-250
for log in /tmp/tune/trials/*/train.log; do echo "$(basename $(dirname $log)) $(grep -c 'Recompiling function' $log)"; done \
  > /tmp/tune/recompiles.txt 2>/dev/null
cp /tmp/tune.log /tmp/tune/tune.log
tar -czf $OUT/tune.tgz --exclude='run' --exclude='*.safetensors' --exclude='rows' -C /tmp tune 2>/dev/null
cat /tmp/tune/recompiles.txt; echo "call took $(( $(date +%s) - T0 )) s"
