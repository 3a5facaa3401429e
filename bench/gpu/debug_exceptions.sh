# Diagnoses the SIGSEGV seen when a driver error is thrown inside Arena::apply on the GPU image.
set -uo pipefail
export PYTHONUNBUFFERED=1
bash bench/gpu/build.sh > $OUT/build.log 2>&1; source /tmp/dynoff-env.sh
cat > /tmp/probe.py <<'PY'
from dynoff.allocator import _vmm
a = _vmm.Arena("host", 0, 0, True)
r = a.reserve(1)
a.create_pages(1); p = a.allocate_pages(1)
a._inject_failure(0)
try:
    a.apply([(r, 0, p[0])], False)
except RuntimeError as e:
    print("caught driver error:", e)
PY
python3 -c "import sysconfig; print(sysconfig.get_config_var('LDSHARED')); print(sysconfig.get_config_var('CC'), sysconfig.get_config_var('CFLAGS'))"
cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 /tmp/probe.py 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -60
