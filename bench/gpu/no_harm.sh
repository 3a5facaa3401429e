#!/usr/bin/env bash
# GPU machine, warm after parcels 1, 2 and the serve parcel (../shared/gpu/README.md). One system
# per call: `vllm serve` (stock defaults, or the README's plugin flags) driven by `vllm bench serve`,
# one point after another on the same server.
#   bash bench/gpu/no_harm.sh SYSTEM MODEL REGIME "WORKLOAD: TRACE-ARGS" ["WORKLOAD: TRACE-ARGS" ...]
#   e.g. bash bench/gpu/no_harm.sh plugin qwen3-32b b "bursty: bursty --lull-s 15 --burst-s 30 --cycles 1" \
#          "sharegpt: poisson --rate 16 --seconds 60"
# PLUGIN_CONFIG='{"home": "device", ...}' (environment) adds to the plugin's configuration, e.g.
# the fast-link emulation of issue 22. SERVER_ARGS='--kv-offloading-size 16' (environment) adds
# vLLM flags to the server, stock or plugin alike (the CPU KV tier issue), and LABEL names the
# system in the files (default: SYSTEM), e.g. LABEL=plugin_kvoff.
# SYSTEM: stock | plugin. REGIME a = gpu_memory_utilization 0.9, b = 0.62, or the fraction
# itself (e.g. 0.85). TRACE-ARGS go to
# bench.traces (shape first: poisson | bursty). Writes $OUT/<label>_<regime>_<workload>[_seed<S>]_<n>_<card>.json
# per point and the server's log.
# Every server compiles its model's graph, in a vLLM cache of its own: a server that loads the
# graph from vLLM's compile cache profiles less activation, so gets more KV, than one that
# compiles it (1.48 against 1.61 GiB for Qwen3-32B on an H100, 28 blocks; stock and plugin
# alike, bench.serve_bench.server_profile), so a stock / plugin pair compares like with like
# only where both graphs came the same way (bench.no_harm reports `same_graph_source`).
# COMPILE_CACHE=reuse shares one cache among the machine's servers and unpacks the carried
# one (.stage/compile_cache, compile_cache.sh): ~40 s faster starts, for runs not compared.
set -uo pipefail
source bench/gpu/card.sh
export PYTHONUNBUFFERED=1
if [ "${COMPILE_CACHE:-fresh}" = reuse ]; then
  export VLLM_CACHE_ROOT=/tmp/site/vllm-cache
  source bench/gpu/compile_cache.sh
  compile_cache_restore
else
  mkdir -p /tmp/site
  VLLM_CACHE_ROOT=$(mktemp -d /tmp/site/vllm-cache-fresh.XXXXXX)
  export VLLM_CACHE_ROOT
  trap 'rm -rf "$VLLM_CACHE_ROOT"' EXIT  # gone however the script ends
fi
system="$1"; model="$2"; regime="$3"; shift 3
label="${LABEL:-$system}"
case "$regime" in
  a) util=0.9 ;;
  b) util=0.62 ;;
  0.[0-9]*) util="$regime" ;;
  *) echo "REGIME must be a (0.9), b (0.62) or a memory fraction such as 0.3"; exit 2 ;;
esac
[ "$#" -ge 1 ] || { echo "give at least one \"WORKLOAD: TRACE-ARGS\""; exit 2; }
[ -f /tmp/dynoff-env.sh ] || bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
points=()
n=0
for spec in "$@"; do
  workload="${spec%%:*}"; args="${spec#*:}"; args="${args# }"
  [ "$workload" != "$spec" ] || { echo "point \"$spec\" must read \"WORKLOAD: TRACE-ARGS\""; exit 2; }
  trace="/tmp/trace_${regime}_${workload}_${n}.jsonl"
  # shellcheck disable=SC2086  # the trace arguments are words
  python3 -m bench.traces $args --out "$trace" || exit 2
  point=$(printf '{"regime": "%s", "workload": "%s", "trace": "%s"}' "$regime" "$workload" "$args")
  # a trace's seed names its file: repetitions of one point in later calls do not collide
  seed=$(sed -n 's/.*--seed \([0-9][0-9]*\).*/_seed\1/p' <<< "$args")
  points+=(--trace "$trace" --point "$point" --out "$OUT/${label}_${regime}_${workload}${seed}_${n}_${card}.json")
  n=$((n + 1))
done
extra=()
[ -z "${PLUGIN_CONFIG:-}" ] || extra=(--plugin-config "$PLUGIN_CONFIG")
for word in ${SERVER_ARGS:-}; do extra+=("--server-arg=$word"); done
python3 -m bench.serve_bench --system "$system" --model "/tmp/site/models/$model" \
  --gpu-memory-utilization "$util" "${points[@]}" "${extra[@]}" --log "$OUT/${label}_server.log"
rc=$?
grep -h "dynamic offload\|Available KV\|KV cache size\|Actual usage\|offloading" "$OUT/${label}_server.log" | cut -c1-400 | tail -30
[ "${COMPILE_CACHE:-fresh}" != reuse ] || compile_cache_keep
exit $rc
