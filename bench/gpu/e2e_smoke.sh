#!/usr/bin/env bash
# GPU machine, after the two staging calls (../shared/gpu/README.md): build, then the e2e smoke.
#   device run (carry .stage/p2):  bash .stage/p2/setup.sh && source /tmp/site/env.sh && bash bench/gpu/e2e_smoke.sh
set -uo pipefail
source bench/gpu/card.sh
export PYTHONUNBUFFERED=1
bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
python3 -m bench.gpu.e2e_smoke --out "$OUT/e2e_smoke_${card}.json"
tail -c 6000 "$OUT/plugin.log" 2>/dev/null | grep -v "^$" | tail -25
