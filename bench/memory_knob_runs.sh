# One 3-step run of the 8-layer memory base (bench/tune_h200_18l_start.yaml, no offload, full recompute) per line of
# stdin ("name --set key=value ..."), its measured peak appended as a JSON line to $1; a run is skipped once $2 seconds
# have passed since $T0 (the call's start) and stopped after $3 seconds. Sourced by bench/calls/gpu_call_memory_knobs.sh
# and bench/calls/gpu_call_2026-12-02_k.sh, with PYTHONPATH set.
knob_out=$1 knob_deadline_s=$2 knob_timeout_s=$3
base="--set model_overrides.num_hidden_layers=8 --set offload.fraction=0 --set steps=3 --set recompute.granularity=full"
while read -r name sets; do
  start=$(date +%s)
  [ $((start - T0)) -gt "$knob_deadline_s" ] && { echo "skipped $name: the call's time is spent"; continue; }
  timeout "$knob_timeout_s" python3 -m openrecipes train bench/tune_h200_18l_start.yaml $base $sets \
    --set run_dir=runs/mem-$name > /tmp/mem-$name.log 2>&1
  rc=$?
  peak=$(python3 -c "import json; print(max((json.loads(l).get('peak_memory_gib') or 0) for l in open('runs/mem-$name/metrics.jsonl')))" 2>/dev/null || echo null)
  echo "{\"variant\": \"$name\", \"sets\": \"$sets\", \"exit\": $rc, \"wall_s\": $(( $(date +%s) - start )), \"measured_peak_gib\": $peak}" >> "$knob_out"
  [ $rc = 0 ] || tail -2 /tmp/mem-$name.log
done
