"""Shared bench helpers: machine/version metadata, JSON results, NVTX ranges."""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    import torch  # here, not at module level: reading and plotting results needs no torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception:  # vLLM is optional for the allocator benchmarks
        info["vllm"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        # Which GPU, not only which kind: two H200s of this fleet differ by up to 6% in step
        # time, so a ratio is only read between runs on the same device.
        info["gpu_uuid"] = str(torch.cuda.get_device_properties(0).uuid)
    else:
        info["gpu"] = None
    return info


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv])


def read_results(path: str | os.PathLike[str]) -> Any:
    """A results file: JSON, or gzip-compressed JSON when its name ends in ``.gz`` (how the
    serving runs are committed: their per-step traces compress about tenfold)."""
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)


def write_results(path: str | os.PathLike[str], results: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": command_line(), "machine": machine_info(), **results}
    out.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return out


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """A matplotlib figure as a PNG of at most 256 colours (its lines and text need no
    more): about a third of matplotlib's own file. The plots are committed, and what
    travels to the GPU machine with each call is bounded (``bench/gpu/README.md``)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    image = Image.open(buffer).convert("RGB")
    palette = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    palette.save(path, format="PNG", optimize=True)
    return Path(path)


def model_or_generated(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.model`` as given, or with ``--cpu`` and no model a freshly generated small Llama."""
    if args.model is not None:
        return
    if not args.cpu:
        parser.error("--model is required on GPU")
    from bench.tiny_checkpoint import make_checkpoint

    args.model = str(make_checkpoint(Path(tempfile.mkdtemp()) / "small-llama"))


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def nearest_rank(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of already sorted values by nearest rank (no interpolation), the
    one rule every latency percentile and error spread in ``bench`` reports."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
