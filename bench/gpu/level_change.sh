#!/usr/bin/env bash
# GPU machine, warm after parcels 1, 2 and the serve parcel (../shared/gpu/README.md). One
# `vllm serve` with the plugin, forced up and down between levels 0 and 1 under a steady
# ShareGPT load, so every change's stall is measured where it matters: in serving.
#   bash bench/gpu/level_change.sh MODEL KV_LAYOUT [RATE] [CYCLES] [STEP_MS]
#   e.g. bash bench/gpu/level_change.sh qwen3-32b packed 8 24
# STEP_MS (default 40, Qwen3-32B's longest decode step under this load) sizes the trace so
# the schedule ends before it does; Qwen3-8B steps take about half as long (20).
# Writes $OUT/level_change_<model>_<layout>_<card>.json (serve_bench's result) and the server
# log; `python -m bench.level_change FILES --out bench/results/level_change_<card>.json` reports.
set -uo pipefail
source bench/gpu/card.sh
export PYTHONUNBUFFERED=1
export VLLM_CACHE_ROOT=/tmp/site/vllm-cache
source bench/gpu/compile_cache.sh
compile_cache_restore
model="$1"; layout="$2"; rate="${3:-8}"; cycles="${4:-24}"; step_ms="${5:-40}"
[ -f /tmp/dynoff-env.sh ] || bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
schedule=$(python3 -m bench.level_change schedule --start 300 --every 40 --cycles "$cycles")
seconds=$(( (300 + 80 * cycles) * step_ms / 1000 + 30 ))  # steps at <= STEP_MS, and a margin
trace="/tmp/trace_level_change.jsonl"
python3 -m bench.traces poisson --rate "$rate" --seconds "$seconds" --out "$trace" || exit 2
python3 -m bench.serve_bench --system plugin --model "/tmp/site/models/$model" \
  --gpu-memory-utilization 0.62 \
  --plugin-config "{\"kv_layout\": \"$layout\", \"level_schedule\": $schedule}" \
  --trace "$trace" --point "{\"workload\": \"level_change\", \"kv_layout\": \"$layout\", \"rate\": $rate}" \
  --out "$OUT/level_change_${model}_${layout}_${card}.json" --log "$OUT/level_change_${model}_${layout}_server.log"
rc=$?
grep -h "dynamic offload" "$OUT/level_change_${model}_${layout}_server.log" | cut -c1-300 | tail -12
python3 -m bench.level_change "$OUT/level_change_${model}_${layout}_${card}.json" --out "$OUT/level_change_report.json"
compile_cache_keep
exit $rc
