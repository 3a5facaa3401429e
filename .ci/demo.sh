#!/usr/bin/env bash
# The README's main job on a CPU: set up (as the test command does), then run vllm serve with
# the plugin, drive it with vllm bench serve, and print the benchmark's summary, the levels
# the server went through and the plugin's lines of /metrics.
#   bash .ci/demo.sh [bench.main_job args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup.sh
step "main job: python -m bench.main_job"
python -m bench.main_job "$@"
