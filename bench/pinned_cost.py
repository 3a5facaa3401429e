"""What page-locked host memory costs in GPU memory (H200): the driver maps registered host
pages into the GPU's address space, and its page tables live in device memory.

    python3 -m bench.pinned_cost --gib 16 --out $OUT/pinned_cost_h200.json

Seen on the H200 under ``vllm serve`` (Qwen3-32B, every layer pinned, 61 GB): the plugin's
non-torch memory exceeded the VMM pages and stock's by 0.15 GiB, 0.6% of the KV cache at
0.62. For each way of pinning ``--gib`` GiB in 1 GiB chunks, this reports the device memory
that went (``cudaMemGetInfo``) per GiB pinned:

* ``register_4k``: ``torch.empty`` + ``cudaHostRegister`` (the plugin's way today);
* ``register_thp``: the same on 2 MiB-aligned memory advised ``MADV_HUGEPAGE``;
* ``host_alloc``: ``cudaHostAlloc`` (``torch.empty(pin_memory=True)``).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
from typing import Any

import torch

from bench.common import write_results

GIB = 1 << 30
MADV_HUGEPAGE = 14


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _register(ptr: int, nbytes: int) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
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


def measure(name: str, chunks: int) -> dict[str, float]:
    torch.cuda.init()
    before = _free()
    held = globals()[name](chunks)
    used = before - _free()
    if name != "host_alloc":  # registered: unregister before the memory goes
        for ptr, _ in held:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    del held
    return {
        "gib_pinned": chunks,
        "device_mib": round(used / 2**20, 2),
        "mib_per_gib": round(used / 2**20 / chunks, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {
        name: measure(name, args.gib) for name in ("register_4k", "register_thp", "host_alloc")
    }
    for name, row in result.items():
        print(f"{name}: {row}", flush=True)
    write_results(args.out, {"ways": result})


if __name__ == "__main__":
    main()
