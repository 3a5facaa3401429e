"""Serving workloads: the cut-off ShareGPT file parses up to the cut, prompts are
deterministic, and only the intended segments (documents, templates) are shared."""

from __future__ import annotations

import json
from collections import Counter

from bench.workloads import docqa, longprompt, prompt_ids, sharegpt_records


def test_records_before_the_cut_are_all_parsed() -> None:
    records = [
        {"id": str(i), "conversations": [{"from": "human", "value": "x" * i}]} for i in range(5)
    ]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"id": "4"') + 3]  # mid-record, as the packaged file is cut
    assert [r["id"] for r in sharegpt_records(cut)] == ["0", "1", "2", "3"]
    assert [r["id"] for r in sharegpt_records(text)] == ["0", "1", "2", "3", "4"]


def test_prompts_are_deterministic_and_share_only_their_segments() -> None:
    a = prompt_ids([[7, 50], [8, 10]])
    assert a == prompt_ids([[7, 50], [8, 10]])
    b = prompt_ids([[7, 50], [9, 10]])
    assert a[:50] == b[:50] and a[50:] != b[50:]
    assert all(3 <= t < 30000 for t in a)


def test_docqa_shape() -> None:
    workload = docqa()
    requests = workload["requests"]
    assert workload["count"] == len(requests) == 16 * 200
    documents = Counter(tuple(r["segments"][0]) for r in requests)
    assert len(documents) == 16 and set(documents.values()) == {200}
    assert len({tuple(r["segments"][1]) for r in requests}) == 10  # templates
    assert all(3900 <= r["segments"][0][1] <= 4300 for r in requests)
    assert all(50 <= r["output"] <= 150 for r in requests)
    first = [tuple(r["segments"][0]) for r in requests[:32]]
    assert len(set(first)) > 4  # shuffled, not grouped by document


def test_long_prompts_share_nothing() -> None:
    requests = longprompt(200)["requests"]
    assert len({r["segments"][0][0] for r in requests}) == 200
    assert all(3700 <= r["segments"][0][1] <= 4500 for r in requests)
