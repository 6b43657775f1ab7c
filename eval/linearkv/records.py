"""Resumable results of the LinearKV evaluations: one JSON record per line, keyed by `key`."""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path


def load_records(path: Path) -> dict[str, dict]:
    """The records in `path` by key (the last one of a key wins); empty when it does not exist.
    A `.gz` path (the committed reference records) is read through gzip."""
    out: dict[str, dict] = {}
    if path.exists():
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        for line in text.splitlines():
            if line.strip():
                rec = json.loads(line)
                out[rec["key"]] = rec
    return out


@contextlib.contextmanager
def appending(path: Path, records: dict[str, dict]) -> Iterator[Callable[[dict], None]]:
    """A sink that adds a record to `records` and appends it to `path`, flushed at once (an
    interrupted run resumes from what it wrote)."""
    with path.open("a") as fh:
        def sink(rec: dict) -> None:
            records[rec["key"]] = rec
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

        yield sink
