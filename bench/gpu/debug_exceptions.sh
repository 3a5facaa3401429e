# Diagnoses C++ exceptions crossing into Python on the GPU image (seen: segfault on throw).
set -uo pipefail
export PYTHONUNBUFFERED=1
g++ --version | head -1; python3 -m pybind11 --version; python3 -c "import setuptools; print('setuptools', setuptools.__version__)"
bash bench/gpu/build.sh > $OUT/build.log 2>&1; source /tmp/dynoff-env.sh
probe='
import sys
first = sys.argv[1]
if first == "torch": import torch
from dynoff.allocator import _vmm
a = _vmm.Arena("host", 0, 0, True)
try:
    a.reserve(0)
except ValueError as e:
    print("caught ValueError:", e)
a._inject_failure(0)
r = a.reserve(1)
try:
    a.apply([(r, 0, -1)], False)
except ValueError as e:
    print("caught ValueError (validation):", e)
a.create_pages(1); p = a.allocate_pages(1)
try:
    a.apply([(r, 0, p[0])], False)
except RuntimeError as e:
    print("caught driver error:", e)
'
echo "== pip build, torch first"; python3 -c "$probe" torch; echo rc=$?
echo "== pip build, no torch"; python3 -c "$probe" none; echo rc=$?
so=$(python3 -c "import dynoff.allocator._vmm as m; print(m.__file__)")
echo "extension at $so"; ldd "$so" | head
# Variant: default visibility, static libgcc/libstdc++.
g++ -O2 -std=c++17 -shared -fPIC -static-libstdc++ -static-libgcc $(python3 -m pybind11 --includes) -Icsrc \
  csrc/arena.cpp csrc/host_driver.cpp csrc/cuda_driver.cpp csrc/bindings.cpp -ldl -o "$so"
echo "== static libstdc++ build, torch first"; python3 -c "$probe" torch; echo rc=$?
