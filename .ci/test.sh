#!/usr/bin/env bash
# The README's test command: set everything up from nothing, lint, and run the tests.
#   bash .ci/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup.sh
step "lint"
ruff check .
ruff format --check .
mypy allocator policy compile_pass bench
step "tests (CPU; GPU tests skip)"
python -m pytest "$@"
step "done"
