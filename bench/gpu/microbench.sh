#!/usr/bin/env bash
# GPU machine, warm after the staging calls (../shared/gpu/README.md):
#   device run:  source /tmp/site/env.sh && bash bench/gpu/microbench.sh MODEL "LEVELS" [args]
#   e.g.         bash bench/gpu/microbench.sh qwen3-32b "1 2 4 8 16" --profile-level 4
#                bash bench/gpu/microbench.sh llama-3.1-70b "1 2 4 8" --quantization fp8
# Builds the package if this machine has not yet, then one engine sweeps the levels.
set -uo pipefail
source bench/gpu/card.sh
export PYTHONUNBUFFERED=1
model="$1"; levels="$2"; shift 2
[ -f /tmp/dynoff-env.sh ] || bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
# shellcheck disable=SC2086  # the levels are a word list
python3 -m bench.microbench --model "/tmp/site/models/$model" --levels $levels \
  --out "$OUT/microbench_${model}_${card}.json" --workdir "/tmp/dynoff-microbench-$model" "$@" \
  > "$OUT/microbench_${model}.log" 2>&1
rc=$?
grep -v "^\s*$" "$OUT/microbench_${model}.log" | grep -v "it/s]" | tail -40
exit $rc
