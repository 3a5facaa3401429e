#!/usr/bin/env bash
# Builds and installs this package on the GPU machine (its image's Python 3.12, torch 2.11,
# pybind11, setuptools; no network). Falls back to compiling the extension directly and
# exposing the source folders as the `dynoff` namespace when the image's setuptools is too old
# for pyproject's metadata.
set -euo pipefail
cd "$(dirname "$0")/../.."
if python3 -m pip install -q --no-build-isolation --no-deps --no-index . 2>/tmp/dynoff-pip.log; then
  echo "dynoff: installed with pip"
else
  tail -5 /tmp/dynoff-pip.log
  shim=/tmp/dynoff-shim/dynoff
  mkdir -p "$shim"
  for pkg in allocator compile_pass policy; do ln -sfn "$PWD/$pkg" "$shim/$pkg"; done
  g++ -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -Wall -Wextra -Werror \
      -Wno-missing-field-initializers $(python3 -m pybind11 --includes) -Icsrc \
      csrc/arena.cpp csrc/host_driver.cpp csrc/cuda_driver.cpp csrc/bindings.cpp -ldl \
      -o "allocator/_vmm$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  echo "export PYTHONPATH=/tmp/dynoff-shim\${PYTHONPATH:+:\$PYTHONPATH}" > /tmp/dynoff-env.sh
  echo "dynoff: built in place, namespace shim at /tmp/dynoff-shim (source /tmp/dynoff-env.sh)"
fi
touch /tmp/dynoff-env.sh
