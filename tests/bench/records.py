"""Hand-made ``bench.serve_bench`` records for the report tests, written as the runs are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_records(tmp_path: Path, records: list[Any]) -> list[str]:
    """Each record to its own JSON file under ``tmp_path``; their paths, in order."""
    paths = []
    for i, record in enumerate(records):
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(record))
        paths.append(str(path))
    return paths
