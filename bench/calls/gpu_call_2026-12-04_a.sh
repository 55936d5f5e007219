# One H200, call a (2026-12-04): whether the trial zygote can import Inductor before it forks under torch's NVML CUDA
# check (bench/compile_preload.py, every variant), the zygote's own check, then the tuner from LoRA of all 48 layers
# within 5 minutes as calls zz2, zz4 and zz5 ran it, now with Inductor preloaded and compile time in the budget.
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_2026-12-04_a.sh
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 150 python3 bench/compile_preload.py 1 | tee $OUT/compile_preload.jsonl | cut -c1-330
timeout 60 python3 -c "
import time; t = time.monotonic()
from openrecipes.tune.zygote import Zygote
z = Zygote(); print('zygote ready in', round(time.monotonic() - t, 1), 's, inductor preloaded:', z.inductor); z.close()"
python3 bench/h200_rows.py /tmp/in8 250
timeout 60 python3 -m openrecipes data build /tmp/in8/docs.jsonl --format pretrain --row-tokens 8192 --rows 24 \
  --no-progress --out tune-rows 2>&1 | tail -1
start=$(date +%s)
TORCH_LOGS=recompiles timeout $(( ${MINUTES:-5} * 60 + 40 )) python3 -m openrecipes tune bench/tune_h200_lora48_start.yaml \
  --gpus 1xH200 --minutes ${MINUTES:-5} --trials 8 --trial-steps 12 --remeasure 1 --out /tmp/tune > /tmp/tune.log 2>&1
echo "{\"exit\": $?, \"wall_s\": $(( $(date +%s) - start ))}" | tee $OUT/tune_wall.json
tail -32 /tmp/tune.log | cut -c1-260
for log in /tmp/tune/trials/*/train.log; do echo "$(basename $(dirname $log)) $(grep -c 'Recompiling function' $log)"; done \
  > /tmp/tune/recompiles.txt 2>/dev/null
for s in /tmp/tune/trials/*/run/startup.json; do echo "$(basename $(dirname $(dirname $s))) $(tr -d ' \n' < $s)"; done
cp /tmp/tune.log /tmp/tune/tune.log
tar -czf $OUT/tune.tgz --exclude='run' --exclude='*.safetensors' --exclude='rows' -C /tmp tune 2>/dev/null
cat /tmp/tune/recompiles.txt; echo "call took $(( $(date +%s) - T0 )) s"
