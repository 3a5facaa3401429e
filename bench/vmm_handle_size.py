"""Why a 2 MiB-page level transition costs what it does: per-call cost of cuMemMap,
cuMemSetAccess and cuMemUnmap against the size of the physical handle, and whether issuing
2 MiB calls from several threads overlaps them. Uses cuda.bindings directly (GPU only).

    python bench/vmm_handle_size.py --out bench/results/vmm_handle_size_h200.json
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from cuda.bindings import driver as cu

from bench.common import median, write_results

MIB = 1 << 20


def ok(result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def prop() -> cu.CUmemAllocationProp:
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = torch.cuda.current_device()
    return p


def access(read_write: bool = True) -> cu.CUmemAccessDesc:
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = torch.cuda.current_device()
    d.flags = (
        cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        if read_write
        else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    )
    return d


def per_call(size: int, repeats: int) -> dict[str, float]:
    """µs per map / set_access / unmap call for one handle of `size` bytes."""
    handle = ok(cu.cuMemCreate(size, prop(), 0))
    va = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    rows: dict[str, list[float]] = {"map": [], "set_access": [], "unmap": []}
    desc = access()
    for _ in range(repeats):
        t0 = time.perf_counter()
        ok(cu.cuMemMap(va, size, 0, handle, 0))
        t1 = time.perf_counter()
        ok(cu.cuMemSetAccess(va, size, [desc], 1))
        t2 = time.perf_counter()
        ok(cu.cuMemUnmap(va, size))
        t3 = time.perf_counter()
        rows["map"].append((t1 - t0) * 1e6)
        rows["set_access"].append((t2 - t1) * 1e6)
        rows["unmap"].append((t3 - t2) * 1e6)
    ok(cu.cuMemAddressFree(va, size))
    ok(cu.cuMemRelease(handle))
    return {k: median(v) for k, v in rows.items()}


def threaded(pages: int, threads: int, page: int) -> float:
    """Wall ms to map + set access + unmap `pages` 2 MiB pages, split over `threads`."""
    handles = [ok(cu.cuMemCreate(page, prop(), 0)) for _ in range(pages)]
    va = int(ok(cu.cuMemAddressReserve(pages * page, 0, 0, 0)))
    desc = access()
    ctx = ok(cu.cuCtxGetCurrent())

    def work(chunk: range) -> None:
        ok(cu.cuCtxSetCurrent(ctx))
        for i in chunk:
            ok(cu.cuMemMap(va + i * page, page, 0, handles[i], 0))
            ok(cu.cuMemSetAccess(va + i * page, page, [desc], 1))
        for i in chunk:
            ok(cu.cuMemUnmap(va + i * page, page))

    step = -(-pages // threads)
    chunks = [range(s, min(s + step, pages)) for s in range(0, pages, step)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, chunks))
    wall = (time.perf_counter() - t0) * 1e3
    ok(cu.cuMemAddressFree(va, pages * page))
    for h in handles:
        ok(cu.cuMemRelease(h))
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/vmm_handle_size_h200.json")
    args = parser.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # primary context current on this thread
    sizes = [2 * MIB, 16 * MIB, 128 * MIB, 1024 * MIB]
    table = {f"{s // MIB}MiB": per_call(s, args.repeats) for s in sizes}
    for name, row in table.items():
        print(name, {k: round(v, 1) for k, v in row.items()})
    threads = {str(t): threaded(465, t, 2 * MIB) for t in (1, 2, 4, 8)}
    print("465 pages map+access+unmap, ms by thread count:", threads)
    write_results(args.out, {"us_per_call_by_handle_size": table, "threads_465_pages_ms": threads})


if __name__ == "__main__":
    main()
