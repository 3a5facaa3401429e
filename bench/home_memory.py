"""The KV cache each server got at start-up, from their ``vllm serve`` logs: stock against the
plugin with its homes in the driver's host pages and in memory locked with
``cudaHostRegister`` (the ``host_memory`` key). vLLM's profile counts the page tables of
registered memory (2 MiB of GPU memory per GiB homed) against the KV cache; at level 0 the
plugin should get what stock gets, less its VMM pages' own cost.

    python -m bench.home_memory stock=S.log plugin_driver=D.log plugin_register=R.log \\
        --out bench/results/home_memory_h100.json

Each log is the server's (``bench/gpu/no_harm.sh`` writes ``<label>_server.log``); the first
label is the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from bench.common import write_results

_AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_HOMES = re.compile(r"(\d+) layers homed on the host \(([^;]+);")
_PINNED = re.compile(r"(\d+) layers pinned on the host")  # before the homes had a way


def read_log(text: str) -> dict[str, Any]:
    """The start-up figures of one server's log; a figure the log lacks is None."""
    available = _AVAILABLE.findall(text)
    tokens = _TOKENS.findall(text)
    homes = _HOMES.findall(text)
    pinned = _PINNED.findall(text)
    row: dict[str, Any] = {
        "available_kv_gib": float(available[-1]) if available else None,
        "kv_tokens": int(tokens[-1].replace(",", "")) if tokens else None,
        "layers_homed": int(homes[-1][0]) if homes else int(pinned[-1]) if pinned else 0,
        "homes": homes[-1][1] if homes else ("cudaHostRegister" if pinned else None),
    }
    return row


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each system's KV memory against the first's (the baseline)."""
    base_label = next(iter(rows))
    base = rows[base_label]["available_kv_gib"]
    ratios = {}
    for label, row in rows.items():
        kv = row["available_kv_gib"]
        ratios[label] = None if not base or kv is None else round(kv / base, 5)
    return {"baseline": base_label, "systems": rows, "available_kv_ratio": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="LABEL=PATH, the baseline first")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = {}
    for spec in args.logs:
        label, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"{spec!r}: give LABEL=PATH, e.g. stock=$OUT/stock_server.log")
        rows[label] = read_log(Path(path).read_text(errors="replace"))
    result = compare(rows)
    for label, row in rows.items():
        print(
            f"{label}: {row['available_kv_gib']} GiB of KV ({row['kv_tokens']} tokens), "
            f"{row['layers_homed']} layers homed ({row['homes']}), "
            f"x{result['available_kv_ratio'][label]} of {result['baseline']}",
            flush=True,
        )
    write_results(args.out, result)


if __name__ == "__main__":
    main()
