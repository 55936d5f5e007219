set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/typing_extensions*.whl
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version)"
timeout 560 python3 bench/engine_speed.py --out $OUT/engine_speed-4gpu.json --variants dp2_pa_bal,dp2ep2_pa_bal,tp2_pa_bal,cp2_pa_bal,dp4ep4_pa_bal,dp4ep2_pa_bal,tp2dp2ep4_pa_bal,dp2ep2_pa_off_bal 2>&1 | grep -v "^step\|it/s\|%|" | tail -60
