#!/usr/bin/env bash
# GPU machine, warm after the staging calls (../shared/gpu/README.md):
#   device run:  source /tmp/site/env.sh && bash bench/gpu/e2e_correctness.sh identity|live [--engines ...]
# Builds the package if this machine has not yet, then runs bench.gpu.e2e_correctness.
set -uo pipefail
source bench/gpu/card.sh
export PYTHONUNBUFFERED=1
phase="${1:-identity}"; shift || true
[ -f /tmp/dynoff-env.sh ] || bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
python3 -m bench.gpu.e2e_correctness --model /tmp/site/models/qwen3-8b --phase "$phase" \
  --out "$OUT/e2e_correctness_${phase}_${card}.json" "$@"
