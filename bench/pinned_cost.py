"""What page-locked host memory costs in GPU memory (H200): the driver maps registered host
pages into the GPU's address space, and its page tables live in device memory.

    python3 -m bench.pinned_cost --gib 16 --out $OUT/pinned_cost_h200.json

Seen on the H200 under ``vllm serve`` (Qwen3-32B, every layer pinned, 61 GB): the plugin's
non-torch memory exceeded the VMM pages and stock's by 0.15 GiB, 0.6% of the KV cache at
0.62. For each way of pinning ``--gib`` GiB in 1 GiB chunks, this reports the device memory
that went (``cudaMemGetInfo``) per GiB pinned:

* ``register_4k``: ``torch.empty`` + ``cudaHostRegister`` (the plugin's way today);
* ``register_thp``: the same on 2 MiB-aligned memory advised ``MADV_HUGEPAGE``;
* ``host_alloc``: ``cudaHostAlloc`` (``torch.empty(pin_memory=True)``);
* ``vmm_host``: the driver's own host pages, ``cuMemCreate`` at ``CU_MEM_LOCATION_TYPE_HOST``
  (2 MiB granularity), mapped with ``cuMemMap`` and made readable by the device and
  writable by the CPU with ``cuMemSetAccess``: the hope was that the GPU maps these at the
  allocation's granularity, not 4 KiB. It does not: 2.0 MiB per GiB on the H100, as
  ``cudaHostRegister`` (``bench/results/pinned_cost_h100.json``).

Pinning late (a layer's home locked only when a level first offloads it) would spare the
page tables of the levels never used; what it would cost is in ``register_ms_per_gib`` (one
``cudaHostRegister`` of already-written memory) and ``device_mib_after_release`` (the
device memory still gone once the way's memory is unpinned and freed).

With each way's device cost goes the H2D copy speed of one 1 GiB chunk (``cuMemcpy`` into
a device tensor, the best of three): a home that costs nothing but copies slower is no home.
A way the driver refuses is reported with its error, not dropped.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import time
from typing import Any

import torch

from bench.common import write_results

GIB = 1 << 30
MADV_HUGEPAGE = 14


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


REGISTER_S: list[float] = []  # each cudaHostRegister's wall time, this way's


def _register(ptr: int, nbytes: int) -> None:
    start = time.perf_counter()
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    REGISTER_S.append(time.perf_counter() - start)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({rc})")


def register_4k(chunks: int) -> list[Any]:
    held = []
    for _ in range(chunks):
        t = torch.empty(GIB, dtype=torch.uint8)
        t.zero_()
        _register(t.data_ptr(), GIB)
        held.append((t.data_ptr(), t))
    return held


def register_thp(chunks: int) -> list[Any]:
    libc = ctypes.CDLL(None, use_errno=True)
    held = []
    for _ in range(chunks):
        region = mmap.mmap(-1, GIB + (2 << 20))
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        aligned = -(-base // (2 << 20)) * (2 << 20)
        libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(GIB), MADV_HUGEPAGE)
        ctypes.memset(aligned, 0, GIB)
        _register(aligned, GIB)
        held.append((aligned, region))
    return held


def host_alloc(chunks: int) -> list[Any]:
    return [torch.empty(GIB, dtype=torch.uint8, pin_memory=True) for _ in range(chunks)]


# The driver API for vmm_host (cuda.h values).
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _cuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {rc} ({(name.value or b'?').decode()})")


def vmm_host(chunks: int) -> list[Any]:
    cu = _cuda()
    prop = _AllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _Location(CU_MEM_LOCATION_TYPE_HOST, 0)
    granularity = ctypes.c_size_t()
    _check(
        cu.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop), 0),
        "cuMemGetAllocationGranularity(HOST)",
    )
    print(f"vmm_host: granularity {granularity.value} bytes", flush=True)
    access = (_AccessDesc * 2)(
        _AccessDesc(
            _Location(CU_MEM_LOCATION_TYPE_DEVICE, torch.cuda.current_device()),
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        ),
        _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_HOST, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
    )
    held = []
    for _ in range(chunks):
        handle, va = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        _check(
            cu.cuMemCreate(
                ctypes.byref(handle),
                ctypes.c_size_t(GIB),
                ctypes.byref(prop),
                ctypes.c_ulonglong(0),
            ),
            "cuMemCreate(HOST)",
        )
        _check(
            cu.cuMemAddressReserve(
                ctypes.byref(va),
                ctypes.c_size_t(GIB),
                ctypes.c_size_t(0),
                ctypes.c_ulonglong(0),
                ctypes.c_ulonglong(0),
            ),
            "cuMemAddressReserve",
        )
        _check(
            cu.cuMemMap(
                va, ctypes.c_size_t(GIB), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)
            ),
            "cuMemMap",
        )
        _check(
            cu.cuMemSetAccess(va, ctypes.c_size_t(GIB), access, ctypes.c_size_t(2)),
            "cuMemSetAccess(device, host)",
        )
        ctypes.memset(va.value, 0, GIB)  # the CPU writes it: a home is filled by the CPU
        held.append((va.value, handle.value))
    return held


def _release_vmm(held: list[Any]) -> None:
    cu = _cuda()
    for va, handle in held:
        _check(cu.cuMemUnmap(ctypes.c_ulonglong(va), ctypes.c_size_t(GIB)), "cuMemUnmap")
        _check(cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")
        _check(
            cu.cuMemAddressFree(ctypes.c_ulonglong(va), ctypes.c_size_t(GIB)), "cuMemAddressFree"
        )


def _host_view(ptr: int) -> torch.Tensor:
    """A CPU tensor over 1 GiB at host address ``ptr`` (how a home would be handed to torch)."""
    return torch.frombuffer((ctypes.c_uint8 * GIB).from_address(ptr), dtype=torch.uint8)


def _h2d(src: int) -> dict[str, Any]:
    """1 GiB from host address ``src`` to the device, the best of three: with ``cuMemcpy``,
    and as the prefetch engine copies (``copy_(non_blocking=True)`` of a CPU tensor over the
    memory, on a side stream); ``enqueue_ms``: how long that call held the CPU (a copy torch
    or the driver took for pageable would hold it for the whole copy)."""
    cu = _cuda()
    dst = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    view = _host_view(src)
    stream = torch.cuda.Stream()
    driver = torch_best = enqueue = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _check(
            cu.cuMemcpy(
                ctypes.c_ulonglong(dst.data_ptr()), ctypes.c_ulonglong(src), ctypes.c_size_t(GIB)
            ),
            "cuMemcpy",
        )
        driver = min(driver, time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            dst.copy_(view, non_blocking=True)
        enqueue = min(enqueue, time.perf_counter() - start)
        stream.synchronize()
        torch_best = min(torch_best, time.perf_counter() - start)
    return {
        "copied_right": bool(dst[: 1 << 20].eq(0x5A).all().item()),
        "h2d_GBps": round(GIB / driver / 1e9, 2),
        "torch_h2d_GBps": round(GIB / torch_best / 1e9, 2),
        "enqueue_ms": round(enqueue * 1e3, 3),
        "is_pinned": bool(view.is_pinned()),
    }


def measure(name: str, chunks: int) -> dict[str, Any]:
    torch.cuda.init()
    torch.cuda.current_device()
    before = _free()
    REGISTER_S.clear()
    try:
        held = globals()[name](chunks)
    except Exception as e:  # a way the driver refuses is a finding, not a crash
        return {"error": f"{type(e).__name__}: {e}"}
    used = before - _free()
    first = held[0][0] if name != "host_alloc" else held[0].data_ptr()
    ctypes.memset(first, 0x5A, 1 << 20)  # the copies must carry what the CPU wrote
    try:
        speed = _h2d(first)
    except Exception as e:
        speed = {"copy_error": f"{type(e).__name__}: {e}"}
    if name == "vmm_host":
        _release_vmm(held)
    elif name != "host_alloc":  # registered: unregister before the memory goes
        for ptr, _ in held:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    del held
    torch.cuda.empty_cache()  # the copy's device tensor
    kept = before - _free()  # what unpinning did not give back
    return {
        "gib_pinned": chunks,
        "device_mib": round(used / 2**20, 2),
        "mib_per_gib": round(used / 2**20 / chunks, 3),
        "device_mib_after_release": round(kept / 2**20, 2),
        **(
            {"register_ms_per_gib": round(sum(REGISTER_S) / len(REGISTER_S) * 1e3, 2)}
            if REGISTER_S
            else {}
        ),
        **speed,
    }


WAYS = ("register_4k", "register_thp", "host_alloc", "vmm_host")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--ways",
        nargs="+",
        choices=WAYS,
        default=list(WAYS),
        help="the ways to measure, in this order (one per process avoids the driver reusing "
        "one way's freed page tables for the next: H100, register_thp and host_alloc read "
        "1.0 MiB per GiB after register_4k, 2.0 on the H200 at 16 GiB)",
    )
    args = parser.parse_args()
    result = {name: measure(name, args.gib) for name in args.ways}
    for name, row in result.items():
        print(f"{name}: {row}", flush=True)
    write_results(args.out, {"ways": result})


if __name__ == "__main__":
    main()
