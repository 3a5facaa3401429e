"""Request traces for vLLM's own benchmark client, ``vllm bench serve --dataset-name
timed_trace`` (JSON lines: ``timestamp`` s, ``input_length``, ``output_length``, ``hash_ids``).

Lengths come from the committed workloads (``bench/workloads/*.json``); arrival times from a
seeded Poisson process whose rate may change over time:

* ``poisson``: one rate for a duration (ShareGPT lengths at a rate around the knee);
* ``bursty``: lulls and bursts alternating (the non-stationary load a policy must follow);
* any workload file, e.g. ``longprompt`` (~4,100 tokens in, 50-150 out).

``hash_ids`` give each request's prompt its own 16-token chunks (vLLM's client expands every
id into 16 tokens), and segments a workload shares (doc QA's documents) the same chunks, so
prefix caching sees what the workload has.

    python -m bench.traces bursty --workload sharegpt --lull-rate 3 --burst-rate 18 \\
        --lull-s 40 --burst-s 40 --cycles 3 --out /tmp/bursty.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

WORKLOADS = Path(__file__).parent / "workloads"
CHUNK = 16  # tokens per hash id (vllm bench serve's --timed-trace-chunk-hash-size default)


@dataclasses.dataclass(frozen=True)
class Phase:
    rate: float  # requests per second
    seconds: float


def phases_bursty(
    lull_rate: float, burst_rate: float, lull_s: float, burst_s: float, cycles: int
) -> list[Phase]:
    """A lull, then a burst, ``cycles`` times, and a closing lull."""
    phases = []
    for _ in range(cycles):
        phases += [Phase(lull_rate, lull_s), Phase(burst_rate, burst_s)]
    return [*phases, Phase(lull_rate, lull_s)]


def arrivals(phases: Sequence[Phase], seed: int) -> list[float]:
    """Poisson arrival times over piecewise-constant rates."""
    rng = random.Random(seed)
    times: list[float] = []
    start = 0.0
    for phase in phases:
        t = start
        while phase.rate > 0:
            t += rng.expovariate(phase.rate)
            if t >= start + phase.seconds:
                break
            times.append(t)
        start += phase.seconds
    return times


def requests(workload: str) -> list[dict]:
    return json.loads((WORKLOADS / f"{workload}.json").read_text())["requests"]


def hash_ids(segments: Sequence[Sequence[int]]) -> list[int]:
    """One id per 16 tokens of each segment; a segment keeps its ids wherever it recurs."""
    return [sid * 10_000 + j for sid, length in segments for j in range(math.ceil(length / CHUNK))]


def trace(workload: str, phases: Sequence[Phase], seed: int = 0) -> Iterator[dict]:
    pool = requests(workload)
    rng = random.Random(seed + 1)
    order = list(range(len(pool)))
    rng.shuffle(order)
    for n, t in enumerate(arrivals(phases, seed)):
        request = pool[order[n % len(order)]]
        yield {
            "timestamp": round(t, 4),
            "input_length": sum(length for _, length in request["segments"]),
            "output_length": request["output"],
            "hash_ids": hash_ids(request["segments"]),
        }


def write(path: str | Path, records: Iterator[dict]) -> int:
    lines = [json.dumps(r) for r in records]
    Path(path).write_text("\n".join(lines) + "\n")
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=["poisson", "bursty"])
    parser.add_argument("--workload", default="sharegpt")
    parser.add_argument("--rate", type=float, default=10.0, help="poisson: requests/s")
    parser.add_argument("--seconds", type=float, default=120.0, help="poisson: duration")
    parser.add_argument("--lull-rate", type=float, default=3.0)
    parser.add_argument("--burst-rate", type=float, default=18.0)
    parser.add_argument("--lull-s", type=float, default=40.0)
    parser.add_argument("--burst-s", type=float, default=40.0)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.shape == "poisson":
        phases = [Phase(args.rate, args.seconds)]
    else:
        phases = phases_bursty(
            args.lull_rate, args.burst_rate, args.lull_s, args.burst_s, args.cycles
        )
    count = write(args.out, trace(args.workload, phases, args.seed))
    print(f"{args.out}: {count} requests over {sum(p.seconds for p in phases):.0f} s")


if __name__ == "__main__":
    main()
