#!/usr/bin/env bash
# GPU machine, one call: build, GPU allocator tests, compute-sanitizer memcheck over them, and
# the VMM microbenchmark. Results land in $OUT (copied to bench/results/ by hand afterwards).
#   device run:  bash bench/gpu/allocator.sh
set -uo pipefail
source bench/gpu/card.sh
export PYTHONUNBUFFERED=1
bash bench/gpu/build.sh 2>&1 | tee "$OUT/build.log"
source /tmp/dynoff-env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu tests/allocator -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
# The zero-page test faults on purpose (in a child process), so memcheck runs the rest.
compute-sanitizer --tool memcheck --target-processes all \
  python3 -m pytest -m gpu tests/allocator -q -p no:cacheprovider -k "not zero_page" \
  2>&1 | tail -25 | tee "$OUT/sanitizer.log"
python3 -m bench.vmm_bench --out "$OUT/vmm_${card}.json" 2>&1 | tee "$OUT/bench.log"
python3 -m bench.vmm_handle_size --out "$OUT/vmm_handle_size_${card}.json" 2>&1 | tee -a "$OUT/bench.log"
