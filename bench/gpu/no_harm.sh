#!/usr/bin/env bash
# GPU machine, warm after parcels 1, 2 and the serve parcel (../shared/gpu/README.md). One system
# per call: `vllm serve` (stock defaults, or the README's plugin flags) driven by `vllm bench serve`.
#   bash bench/gpu/no_harm.sh SYSTEM MODEL REGIME WORKLOAD TRACE-ARGS...
#   e.g. bash bench/gpu/no_harm.sh plugin qwen3-32b b bursty bursty --lull-s 15 --burst-s 30 --cycles 1
# SYSTEM: stock | plugin. REGIME a = gpu_memory_utilization 0.9, b = 0.62. TRACE-ARGS go to
# bench.traces (shape first: poisson | bursty). Writes $OUT/<system>_h200.json and its server log.
set -uo pipefail
export PYTHONUNBUFFERED=1
system="$1"; model="$2"; regime="$3"; workload="$4"; shift 4
case "$regime" in a) util=0.9 ;; b) util=0.62 ;; *) echo "regime must be a or b"; exit 2 ;; esac
[ -f /tmp/dynoff-env.sh ] || bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
trace="/tmp/trace_${regime}_${workload}.jsonl"
python3 -m bench.traces "$@" --out "$trace"
point=$(printf '{"regime": "%s", "workload": "%s", "trace": "%s"}' "$regime" "$workload" "$*")
python3 -m bench.serve_bench --system "$system" --model "/tmp/site/models/$model" \
  --gpu-memory-utilization "$util" --trace "$trace" --point "$point" \
  --out "$OUT/${system}_h200.json" --log "$OUT/${system}_server.log"
rc=$?
grep -h "dynamic offload" "$OUT/${system}_server.log" | cut -c1-300 | tail -25
exit $rc
