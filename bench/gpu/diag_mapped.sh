#!/usr/bin/env bash
# GPU machine, after parcels 1, 2 and the build. Which piecewise GPU test leaves something
# behind that makes the next cudaMalloc fail with "resource already mapped"? (The device
# home's test passes alone and fails right after tests/compile_pass/test_gpu_piecewise.py in
# one process: bench/results/logs/COMMANDS_20261205.md.) Each piecewise test alone, then the
# device home's test in the same process; about 40 s each.
#   bash bench/gpu/diag_mapped.sh > $OUT/diag_mapped.log 2>&1
set -uo pipefail
export PYTHONUNBUFFERED=1
source /tmp/dynoff-env.sh
tests=$(python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider \
  tests/compile_pass/test_gpu_piecewise.py | grep "::")
for t in $tests; do
  echo "== $t, then the device home's test"
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -x "$t" \
    tests/compile_pass/test_gpu_homes.py 2>&1 | grep -E "passed|failed|already mapped|dynoff vmm" | tail -4
done
