#!/usr/bin/env bash
# GPU machine, one call: build, the compile_pass GPU tests (piecewise CUDA graphs over VMM
# weights, copy/compute overlap), and the prefetch benchmark. No vLLM needed.
#   device run:  bash bench/gpu/compile_pass.sh
set -uo pipefail
source bench/gpu/card.sh
export PYTHONUNBUFFERED=1
bash bench/gpu/build.sh > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
source /tmp/dynoff-env.sh
python3 -m pytest -m gpu tests/compile_pass/test_gpu_piecewise.py tests/allocator -q \
  -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu_compile_pass.log"
python3 -m bench.prefetch_bench --out "$OUT/prefetch_${card}.json" 2>&1 | tee "$OUT/prefetch.log"
