# One H200: the planner's peak memory beside the measured peak for each knob the tuner turns (recompute variants,
# rows per microbatch, optimizer and activation offload, compiled blocks, the chunked loss), one knob at a time from
# an 8-layer base at Qwen3-30B-A3B widths (bench/tune_h200_18l_start.yaml at 8 layers, no offload), 3 steps each;
# the rows of the 18-layer tuner benchmark are built first and stay for the next call (tune-rows).
# Run from the repository root with .whl carried:  bash bench/calls/gpu_call_memory_knobs.sh
set -x
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/ors .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/ors:$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
[ -f tune-rows/manifest.json ] || source bench/tune18_rows.sh
source bench/memory_knob_runs.sh $OUT/memory_knobs_measured.jsonl 500 120 <<'VARIANTS'
full-r1
none-r1 --set recompute.granularity=none
selective-r1 --set recompute.granularity=selective
attention_core-r1 --set recompute.granularity=attention_core
experts-r1 --set recompute.granularity=experts
block4-r1 --set recompute.method=block --set recompute.num_layers=4
full-r2 --set layout.rows_per_microbatch=2
full-r4 --set layout.rows_per_microbatch=4
none-r2 --set recompute.granularity=none --set layout.rows_per_microbatch=2
offload0.5-r1 --set offload.fraction=0.5
offload1.0-r4 --set offload.fraction=1.0 --set layout.rows_per_microbatch=4
actoffload-none-r1 --set recompute.granularity=none --set offload.activations=true
compile-r1 --set kernels.compile=true
compile-none-r2 --set kernels.compile=true --set recompute.granularity=none --set layout.rows_per_microbatch=2
chunk2048-r1 --set kernels.loss_chunk_tokens=2048
chunk2048-none-r2 --set kernels.loss_chunk_tokens=2048 --set recompute.granularity=none --set layout.rows_per_microbatch=2
VARIANTS
python3 bench/tune18_predicted.py runs/mem-* > $OUT/memory_knobs_predicted.jsonl
cat $OUT/memory_knobs_measured.jsonl
