"""Every results file README.md and docs/ point to is in the repository and parses (issue 28
item 2, the part that can be checked): a table's numbers can be traced to the file that holds
them. Paths are `docs/results/...` (from the repository root, as README.md and
benchmarks/README.md write them) or `results/...` (relative to the document: from docs/, as the
docs' own links write them; anywhere else such a path points to no results file and fails). A
path that only ever appears as a command's `--out` / `--out-dir` is where a rerun would write (a
withdrawn run's command keeps one), not a citation, and need not exist yet."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_PATH = re.compile(r"(?<![\w/.-])((?:docs/)?results/[A-Za-z0-9_.\-/]+)")
_OUT_FLAG = re.compile(r"--out(?:-dir)?[ =]+$")   # right before a path: the command writes there


def _referenced() -> dict[Path, list[str]]:
    found: dict[Path, list[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        for match in _PATH.finditer(text):
            raw = match.group(1)
            rel = raw.rstrip(".,;:")
            path = ROOT / rel if rel.startswith("docs/") else doc.parent / rel
            out = "--out " if _OUT_FLAG.search(text[max(0, match.start() - 16):match.start()]) else ""
            found.setdefault(path, []).append(f"{doc.relative_to(ROOT)}: {out}{raw}")
    return found


def test_docs_point_to_results_files():
    assert len(_referenced()) >= 20   # the scan finds the docs' results links


def test_every_referenced_results_path_exists():
    missing = {str(p.relative_to(ROOT)): where for p, where in _referenced().items()
               if not p.exists() and not all(": --out " in w for w in where)}
    assert not missing, missing


def _results_files() -> list[Path]:
    out: set[Path] = set()
    for path in _referenced():
        if path.is_dir():
            out.update(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl"))
        elif path.suffix in (".json", ".jsonl"):
            out.add(path)
        elif path.exists():   # a table: the JSON / JSONL files beside it
            out.update(p for p in path.parent.glob("*") if p.suffix in (".json", ".jsonl"))
    return sorted(out)


@pytest.mark.parametrize("path", _results_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_results_file_parses(path: Path):
    text = path.read_text()
    if path.suffix == ".json":
        json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert rows, f"{path} is empty"
