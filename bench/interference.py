"""How the fast-link emulation differs from a DMA link (the fast-link issue, item 2): a decode
and a prefill step of the toy decoder at realistic layer size, alone and while a layer is
copied in beside it, from pinned host memory over PCIe (the real link, a DMA engine) and
from a device home (the emulation: device-to-device copies, paced by
:class:`~dynoff.compile_pass.homes.Pacer` or not).

    python3 -m bench.interference --out $OUT/interference_h200.json

Per step kind (``decode``: ``--decode-tokens`` tokens, ``prefill``: ``--prefill-tokens``) and
copy source it reports the step's median time and its slowdown against the step alone, and
the bandwidth the copies reached meanwhile. The paced copies first run one at a time beside
the step, and ``pacer_achieved_GBps_beside_step`` is the pacer's own moving average then
(the figure the serving report carries). The H100's runs of 2026-12-06 paced with spin
kernels between chunks, which wait for an SM behind every kernel of a busy step: open loop
280-285 GB/s of 390, and with feedback 355 beside a prefill but 718 in the GPU test; the
pacer now is one copy kernel a copy on a few SMs, with deadlines on the GPU's clock.
Besides what is timed, what the emulation costs by construction: a device-to-device copy
reads the home and writes the region, two bytes of HBM traffic per byte moved where a host
copy writes one; and the copy kernel's ``copy_programs`` CTAs occupy as many SMs (of the
GPU's ``multi_processor_count``) while a copy runs, where a DMA engine takes none. Every
figure of the emulation is labelled as one.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench.common import write_results

KINDS = ("decode", "prefill")
SOURCES = ("none", "host_pcie", "device_paced", "device_unpaced")


def summarize(step_ms: dict[str, dict[str, list[float]]], copies: dict[str, Any]) -> dict:
    """``step_ms[kind][source]``: the step times; ``copies[kind][source]``: bytes and
    seconds the copies took meanwhile. Slowdowns are against ``none``."""
    out: dict[str, Any] = {}
    for kind, by_source in step_ms.items():
        alone = statistics.median(by_source["none"])
        rows = {}
        for source, times in by_source.items():
            median = statistics.median(times)
            row: dict[str, Any] = {
                "step_ms": round(median, 3),
                "slowdown": round(median / alone, 4),
            }
            moved = copies.get(kind, {}).get(source)
            if moved and moved["seconds"]:
                row["copy_GBps"] = round(moved["bytes"] / moved["seconds"] / 1e9, 1)
            if source.startswith("device"):
                row["emulation"] = True
            rows[source] = row
        out[kind] = rows
    return out


def _timed_steps(step: Callable[[], None], count: int) -> list[float]:
    times = []
    for _ in range(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in times]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dynoff.compile_pass.homes import WORD, Pacer
    from tests.compile_pass.toy_model import ToyDecoder

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = ToyDecoder(args.layers, args.dim, args.hidden).to(torch.bfloat16)
        model.requires_grad_(False)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    host = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True)
    home = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
    region = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
    shape: dict[str, int] = {}  # the copy kernel's program shape, where the command sets it
    if args.block_kib is not None:
        shape["block_words"] = args.block_kib * 1024 // WORD
    if args.warps is not None:
        shape["warps"] = args.warps
    pacer = Pacer(args.home_GBps, **shape)
    pacer.calibrate(home)
    side = torch.cuda.Stream()

    def copy(source: str) -> None:
        if source == "host_pcie":
            region.copy_(host, non_blocking=True)
        elif source == "device_paced":
            pacer.copy(region, home)
        else:
            region.copy_(home, non_blocking=True)

    step_ms: dict[str, dict[str, list[float]]] = {}
    copies: dict[str, dict[str, dict[str, float]]] = {}
    learned: dict[str, float] = {}  # the pacer's moving average after learning each load
    for kind in KINDS:
        tokens = args.decode_tokens if kind == "decode" else args.prefill_tokens
        x = torch.randn(1, tokens, args.dim, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):  # warm-up: kernels chosen and loaded
            model(x)
        torch.cuda.synchronize()
        step_ms[kind], copies[kind] = {}, {}

        def step(x: torch.Tensor = x) -> None:
            model(x)

        for source in SOURCES:
            if source == "none":
                step_ms[kind][source] = _timed_steps(step, args.steps)
                continue
            # Enough copies queued on the side stream to outlast the timed steps.
            alone_ms = statistics.median(step_ms[kind]["none"])
            with torch.cuda.stream(side):
                copy(source)  # warm-up (and the kernel's compile)
            side.synchronize()
            if source == "device_paced":  # the pacer's average settles beside this step:
                for _ in range(args.pace_warmup):  # one copy at a time beside queued steps
                    step()
                    step()
                    with torch.cuda.stream(side):
                        copy(source)
                    side.synchronize()
                torch.cuda.synchronize()
                pacer.copy(region, home)  # accounts the last one
                torch.cuda.synchronize()
                learned[kind] = round(pacer.achieved_GBps or 0.0, 1)
            one_ms = _copy_ms(functools.partial(copy, source), side)
            count = max(1, int(args.steps * alone_ms * 1.5 / max(one_ms, 1e-3)) + 1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start.record()
                for _ in range(count):
                    copy(source)
                end.record()
            step_ms[kind][source] = _timed_steps(step, args.steps)
            end.synchronize()
            copies[kind][source] = {
                "bytes": float(count * layer_bytes),
                "seconds": start.elapsed_time(end) / 1e3,
            }
    props = torch.cuda.get_device_properties(0)
    return {
        "toy_decoder": {"layers": args.layers, "dim": args.dim, "hidden": args.hidden},
        "layer_bytes": layer_bytes,
        "decode_tokens": args.decode_tokens,
        "prefill_tokens": args.prefill_tokens,
        "home_GBps_target": args.home_GBps,
        "pacer": pacer.describe(),
        "pacer_achieved_GBps_beside_step": learned,
        "steps": summarize(step_ms, copies),
        "by_construction": {
            "hbm_bytes_per_byte_moved": {"host_pcie": 1, "device_paced": 2, "device_unpaced": 2},
            "copy_programs": pacer.programs,
            "copy_program_warps": pacer.warps,
            "copy_block_bytes": pacer.block_words * WORD,
            "multi_processor_count": props.multi_processor_count,
        },
        "emulation": "device_paced and device_unpaced are the fast-link emulation, not a link",
    }


def _copy_ms(copy: Callable[[], None], stream: torch.cuda.Stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        copy()
        end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--pace-warmup",
        type=int,
        default=24,
        help="paced copies, one at a time beside queued steps, before the timed ones: the "
        "pacer's moving average of what they reached settles on this step's load",
    )
    parser.add_argument("--home-GBps", type=float, default=390.0)
    parser.add_argument(
        "--block-kib", type=int, default=None, help="the copy kernel's block (default: 64)"
    )
    parser.add_argument("--warps", type=int, default=None, help="its programs' warps (default: 8)")
    args = parser.parse_args()
    result = run(args)
    write_results(args.out, result)
    for kind, rows in result["steps"].items():
        for source, row in rows.items():
            print(f"{kind:8s} {source:15s} {row}")


if __name__ == "__main__":
    main()
