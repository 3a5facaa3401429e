#!/usr/bin/env bash
# The README's main job on a CPU: set up (as the test command does), then run vLLM's CPU
# engine with dynamic offloading under a burst of requests and print the trace summary.
#   bash .ci/demo.sh [bench.cpu_demo args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup.sh
step "main job: python -m bench.cpu_demo"
python -m bench.cpu_demo "$@"
