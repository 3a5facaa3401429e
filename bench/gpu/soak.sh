#!/usr/bin/env bash
# GPU machine, warm after parcels 1, 2 and the serve parcel (../shared/gpu/README.md). The
# soak of the hardening issue: one `vllm serve` with the plugin, forced to hop across levels
# 0..TOP at random, one change every EVERY steps, CHANGES changes, under a steady ShareGPT
# Poisson load; then the soak report.
#   bash bench/gpu/soak.sh MODEL [CHANGES] [EVERY] [TOP] [RATE] [STEP_MS]
#   e.g. bash bench/gpu/soak.sh qwen3-8b 1050 6 4 8 35
# The defaults fit one 600 s call: ~260 s of traffic after a 120 s (H200) to 192 s (H100)
# start-up; the H100 ran this load at ~35 ms a step.
# Writes $OUT/soak_<model>_<card>.json (serve_bench's result), the server log and
# $OUT/soak_<card>.json (level_changes, failed_requests, resize_failures, recovered, command),
# <card> the GPU's (h200, h100): the same run on an H100 is not the H200's.
set -uo pipefail
export PYTHONUNBUFFERED=1
export VLLM_CACHE_ROOT=/tmp/site/vllm-cache
source bench/gpu/compile_cache.sh
compile_cache_restore
# vLLM's client keeps idle connections 60 s, vllm serve closes them after 5 s: a request sent
# on one the server is closing fails before the server sees it (2026-12-05's soak lost one so).
# The soak measures level changes, not that race: the server keeps connections 75 s.
export VLLM_HTTP_TIMEOUT_KEEP_ALIVE=75
source bench/gpu/card.sh
model="$1"; changes="${2:-1050}"; every="${3:-6}"; top="${4:-4}"; rate="${5:-8}"; step_ms="${6:-35}"
[ -f /tmp/dynoff-env.sh ] || bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
schedule=$(python3 -m bench.level_change soak --start 300 --every "$every" --changes "$changes" --level "$top")
seconds=$(( (300 + every * changes) * step_ms / 1000 + 30 ))  # steps at <= STEP_MS, and a margin
trace="/tmp/trace_soak.jsonl"
python3 -m bench.traces poisson --rate "$rate" --seconds "$seconds" --out "$trace" || exit 2
python3 -m bench.serve_bench --system plugin --model "/tmp/site/models/$model" \
  --gpu-memory-utilization 0.62 \
  --plugin-config "{\"level_schedule\": $schedule, \"policy\": {\"max_level\": $top}}" \
  --trace "$trace" --point "{\"workload\": \"soak\", \"rate\": $rate, \"changes\": $changes}" \
  --out "$OUT/soak_${model}_${card}.json" --log "$OUT/soak_${model}_server.log"
rc=$?
grep -h "dynamic offload" "$OUT/soak_${model}_server.log" | grep -v "level .* -> " | cut -c1-300 | tail -8
python3 -m bench.level_change --soak-report "$OUT/soak_${model}_${card}.json" --out "$OUT/soak_${card}.json"
compile_cache_keep
exit $rc
