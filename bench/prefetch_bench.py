"""Prefetch bandwidth and per-level step time on the GPU (toy decoder, realistic layers).

Measures, in one run: the pinned H2D peak of one layer copy alone, then the H2D bandwidth
the prefetch engine achieves while an offloaded forward runs at k = 4 (copy-stream events
around every copy), and the step time of the piecewise runner at each level. Then the FULL
graph alternative (``--full-levels``): per level, one CUDA graph of the whole forward with
that level's copies and event waits captured inside; its capture time, graph-pool memory
and step time next to the piecewise step time at the same level.

    python -m bench.prefetch_bench --out bench/results/prefetch_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import median, write_results
from dynoff.allocator import VmmArena
from dynoff.compile_pass import runtime
from dynoff.compile_pass.placement import WeightPlacement
from dynoff.compile_pass.prefetch import PrefetchEngine
from tests.compile_pass.piecewise import FullGraphRunner, PiecewiseRunner
from tests.compile_pass.toy_model import ToyDecoder


def cuda_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def h2d_peak(src: torch.Tensor, repeats: int) -> float:
    dst = torch.empty(src.numel(), dtype=torch.uint8, device="cuda")
    ms = cuda_ms(lambda: dst.copy_(src, non_blocking=True), repeats)
    return src.numel() / ms / 1e6


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    n = args.layers
    with torch.device("cuda"):
        model = ToyDecoder(n, args.dim, args.hidden).to(torch.bfloat16).requires_grad_(False)
        x = torch.randn(1, args.tokens, args.dim, dtype=torch.bfloat16)
    placement = WeightPlacement(VmmArena("cuda"), model.layers, max_level=n // 2)
    torch.cuda.empty_cache()
    packs = placement.offloadable()
    engine = PrefetchEngine.for_placement(placement, timing=True)
    rt = runtime.OffloadRuntime(n, engine)
    runtime.install(rt)
    runner = PiecewiseRunner(model, x)
    source = packs[0].cpu
    assert source is not None
    peak = h2d_peak(source, args.repeats)
    step_ms: dict[str, float] = {}
    during = 0.0
    for level in range(n // 2 + 1):
        torch.cuda.synchronize()
        engine.synchronize()
        while placement.level < level:
            placement.raise_level()
        rt.set_level(level)
        for _ in range(3):
            runner()
        engine.timings.clear()
        step_ms[str(level)] = cuda_ms(runner, args.repeats)
        if level == n // 2:
            during = engine.achieved_bandwidth() / 1e9
        print(f"level {level}: step {step_ms[str(level)]:.2f} ms")
    full: dict[str, dict[str, float]] = {}
    engine.timing = False  # timing events are host-side state: not inside a graph
    for level in args.full_levels:
        torch.cuda.synchronize()
        engine.synchronize()
        while placement.level > level:
            placement.lower_level()
        while placement.level < level:
            placement.raise_level()
        rt.set_level(level)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as capture does on entry: count only the graph's pool
        before = torch.cuda.memory_reserved()
        start = time.perf_counter()
        graph = FullGraphRunner(model, x, engine)
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - start
        memory = torch.cuda.memory_reserved() - before
        full[str(level)] = {
            "step_ms": cuda_ms(graph, args.repeats),
            "piecewise_step_ms": step_ms[str(level)],
            "capture_s": round(capture_s, 3),
            "graph_pool_bytes": memory,
        }
        print(f"level {level}: FULL graph {full[str(level)]}")
        del graph
    runtime.install(None)
    result = {
        "model": f"toy decoder, {n} layers, dim {args.dim}, hidden {args.hidden}, bf16",
        "layer_bytes": placement.layer_bytes,
        "tokens_per_step": args.tokens,
        "h2d_peak_GBps": peak,
        "h2d_during_forward_GBps": during,
        "ratio": during / peak,
        "level_measured": n // 2,
        "step_ms_by_level_piecewise": step_ms,
        "full_graph_by_level": full,
    }
    print(f"H2D peak {peak:.1f} GB/s, during forward {during:.1f} GB/s, ratio {during / peak:.3f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--full-levels", type=int, nargs="*", default=[0, 1, 2, 4])
    parser.add_argument("--out", default="bench/results/prefetch_h200.json")
    args = parser.parse_args()
    result = run(args)
    out = Path(args.out)
    if out.exists():  # keep the k = 0 figures measured in vLLM (bench/gpu/e2e_correctness.sh)
        earlier = json.loads(out.read_text())
        result |= {k: v for k, v in earlier.items() if k.startswith("k0_")}
    print(f"wrote {write_results(out, result)}")


if __name__ == "__main__":
    main()
