#!/usr/bin/env bash
# GPU machine, warm after the staging calls (../shared/gpu/README.md). One system per call:
#   device run:  source /tmp/site/env.sh && bash bench/gpu/serving.sh SYSTEM MODEL REGIME WORKLOAD "RATES" [args]
#   e.g.         bash bench/gpu/serving.sh stock qwen3-32b b sharegpt "12 16 19 22" --staircase --window 30
# REGIME a = the whole H200 (gpu_memory_utilization 0.9), b = GH200-sized (0.62).
# SYSTEM: stock | stock-piecewise | dynamic | static | prefetch (see bench/serving.py).
set -uo pipefail
source bench/gpu/card.sh
export PYTHONUNBUFFERED=1
system="$1"; model="$2"; regime="$3"; workload="$4"; rates="$5"; shift 5
case "$regime" in a) util=0.9 ;; b) util=0.62 ;; *) echo "regime must be a or b"; exit 2 ;; esac
[ -f /tmp/dynoff-env.sh ] || bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
name="serving_${model}_${regime}_${workload}_${system}_${card}"
# shellcheck disable=SC2086  # the rates are a word list
python3 -m bench.serving --system "$system" --model "/tmp/site/models/$model" \
  --workload "bench/workloads/$workload.json" --rates $rates --gpu-memory-utilization "$util" \
  --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
rc=$?
grep -v "^\s*$" "$OUT/$name.log" | grep -v "it/s]\|s/rate]\|req/s:" | tail -30
exit $rc
